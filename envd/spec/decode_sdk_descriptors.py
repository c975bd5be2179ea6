"""Reconstruct envd's .proto files from the descriptors embedded in the e2b SDK.

Usage: python decode_sdk_descriptors.py  (writes process/process.proto and
filesystem/filesystem.proto next to this script).

The e2b Python SDK ships the serialized FileDescriptorProto of each envd
service inside its generated *_pb.py modules; this script pulls those bytes
out (without importing the SDK's runtime) and renders proto3 text with the
same packages, messages, field numbers, types, oneofs and proto3 optionals.
"""
import ast
import importlib.util
import os
import sys

from google.protobuf import descriptor_pb2 as d

HERE = os.path.dirname(os.path.abspath(__file__))
GO_MODULE = "forkyard/envd/internal/spec"

T = d.FieldDescriptorProto
SCALARS = {
    T.TYPE_DOUBLE: "double", T.TYPE_FLOAT: "float", T.TYPE_INT64: "int64",
    T.TYPE_UINT64: "uint64", T.TYPE_INT32: "int32", T.TYPE_FIXED64: "fixed64",
    T.TYPE_FIXED32: "fixed32", T.TYPE_BOOL: "bool", T.TYPE_STRING: "string",
    T.TYPE_BYTES: "bytes", T.TYPE_UINT32: "uint32", T.TYPE_SFIXED32: "sfixed32",
    T.TYPE_SFIXED64: "sfixed64", T.TYPE_SINT32: "sint32", T.TYPE_SINT64: "sint64",
}


def sdk_desc_bytes(module_rel):
    spec = importlib.util.find_spec("e2b")
    root = os.path.dirname(spec.origin)
    src = open(os.path.join(root, module_rel)).read()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "file_desc":
            return node.args[0].value
    raise SystemExit(f"no file_desc in {module_rel}")


def rel(pkg, name):
    # ".process.PTY.Size" -> "PTY.Size" inside package process
    name = name.lstrip(".")
    return name[len(pkg) + 1:] if name.startswith(pkg + ".") else name


def ftype(pkg, f):
    if f.type in (T.TYPE_MESSAGE, T.TYPE_ENUM):
        return rel(pkg, f.type_name)
    return SCALARS[f.type]


def render_msg(pkg, m, ind, out):
    p = "  " * ind
    out.append(f"{p}message {m.name} {{")
    maps = {n.name: n for n in m.nested_type if n.options.map_entry}
    for n in m.nested_type:
        if not n.options.map_entry:
            render_msg(pkg, n, ind + 1, out)
    for e in m.enum_type:
        render_enum(e, ind + 1, out)
    real_oneofs = {}
    for f in m.field:
        if f.HasField("oneof_index") and not f.proto3_optional:
            real_oneofs.setdefault(f.oneof_index, []).append(f)
    done_oneofs = set()
    for f in m.field:
        if f.HasField("oneof_index") and not f.proto3_optional:
            oi = f.oneof_index
            if oi in done_oneofs:
                continue
            done_oneofs.add(oi)
            out.append(f"{p}  oneof {m.oneof_decl[oi].name} {{")
            for g in real_oneofs[oi]:
                out.append(f"{p}    {ftype(pkg, g)} {g.name} = {g.number};")
            out.append(f"{p}  }}")
            continue
        label = ""
        if f.label == T.LABEL_REPEATED:
            tn = f.type_name.split(".")[-1]
            if f.type == T.TYPE_MESSAGE and tn in maps:
                me = maps[tn]
                k, v = me.field[0], me.field[1]
                out.append(f"{p}  map<{ftype(pkg, k)}, {ftype(pkg, v)}> {f.name} = {f.number};")
                continue
            label = "repeated "
        elif f.proto3_optional:
            label = "optional "
        out.append(f"{p}  {label}{ftype(pkg, f)} {f.name} = {f.number};")
    out.append(f"{p}}}")


def render_enum(e, ind, out):
    p = "  " * ind
    out.append(f"{p}enum {e.name} {{")
    for v in e.value:
        out.append(f"{p}  {v.name} = {v.number};")
    out.append(f"{p}}}")


def render(fd):
    pkg = fd.package
    out = [
        "// Code reconstructed by decode_sdk_descriptors.py from the e2b SDK's",
        "// embedded FileDescriptorProto. Wire-identical to E2B's envd.",
        'syntax = "proto3";',
        "",
        f"package {pkg};",
        "",
    ]
    for dep in fd.dependency:
        out.append(f'import "{dep}";')
    if fd.dependency:
        out.append("")
    out.append(f'option go_package = "{GO_MODULE}/{pkg}";')
    out.append("")
    for e in fd.enum_type:
        render_enum(e, 0, out)
        out.append("")
    for m in fd.message_type:
        render_msg(pkg, m, 0, out)
        out.append("")
    for s in fd.service:
        out.append(f"service {s.name} {{")
        for mt in s.method:
            cs = "stream " if mt.client_streaming else ""
            ss = "stream " if mt.server_streaming else ""
            out.append(f"  rpc {mt.name}({cs}{rel(pkg, mt.input_type)}) returns ({ss}{rel(pkg, mt.output_type)});")
        out.append("}")
    return "\n".join(out) + "\n"


def main():
    for mod in ("envd/process/process_pb.py", "envd/filesystem/filesystem_pb.py"):
        fd = d.FileDescriptorProto.FromString(sdk_desc_bytes(mod))
        path = os.path.join(HERE, fd.name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(render(fd))
        print("wrote", path, file=sys.stderr)


if __name__ == "__main__":
    main()
