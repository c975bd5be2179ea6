"""WebSocket upgrade through the sandbox proxy (header and host routing)."""

from __future__ import annotations

import socket
import time

from websockets.sync.client import connect

# A stdlib-only WebSocket echo server (RFC 6455 handshake + unfragmented frames).
WS_ECHO = r'''
import base64, hashlib, socket, struct, threading
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
def recvn(c, n):
    b = b""
    while len(b) < n:
        chunk = c.recv(n - len(b))
        if not chunk:
            raise EOFError
        b += chunk
    return b
def handle(c):
    data = b""
    while b"\r\n\r\n" not in data:
        data += c.recv(4096)
    key = [l.split(b":", 1)[1].strip() for l in data.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key")][0]
    acc = base64.b64encode(hashlib.sha1(key + GUID).digest())
    c.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              b"Sec-WebSocket-Accept: " + acc + b"\r\n\r\n")
    try:
        while True:
            h = recvn(c, 2)
            op, ln = h[0] & 15, h[1] & 127
            if ln == 126:
                ln = struct.unpack(">H", recvn(c, 2))[0]
            elif ln == 127:
                ln = struct.unpack(">Q", recvn(c, 8))[0]
            mask = recvn(c, 4)
            p = bytes(b ^ mask[i % 4] for i, b in enumerate(recvn(c, ln)))
            if op == 8:
                c.sendall(b"\x88\x00")
                return
            hdr = bytes([0x80 | op]) + (bytes([ln]) if ln < 126 else b"\x7e" + struct.pack(">H", ln))
            c.sendall(hdr + p)
    except EOFError:
        pass
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 8765))
s.listen()
while True:
    threading.Thread(target=handle, args=(s.accept()[0],), daemon=True).start()
'''


def test_websocket_echo_through_proxy(server, sandbox):
    sandbox.files.write("/home/user/ws.py", WS_ECHO)
    sandbox.commands.run("python3 /home/user/ws.py", background=True)
    headers = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8765"}
    deadline = time.time() + 20
    while True:
        try:
            ws = connect(f"ws://127.0.0.1:{server.port}/echo", additional_headers=headers, open_timeout=5)
            break
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(0.2)
    with ws:
        ws.send("hello")
        assert ws.recv(timeout=10) == "hello"
        ws.send(b"\x00\x01" * 1000)
        assert ws.recv(timeout=10) == b"\x00\x01" * 1000
    # Host-based routing: PORT-ID.DOMAIN.
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    with connect(f"ws://8765-{sandbox.sandbox_id}.localhost:{server.port}/", sock=sock, open_timeout=5) as ws2:
        ws2.send("via host")
        assert ws2.recv(timeout=10) == "via host"
