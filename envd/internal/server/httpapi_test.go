package server

import (
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"io"
	"mime/multipart"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"forkyard/envd/internal/httpapi"
	rpc "forkyard/envd/internal/spec/process"
)

func (e *env) do(method, path string, body io.Reader, hdr map[string]string) (*http.Response, []byte) {
	e.t.Helper()
	req, err := http.NewRequest(method, e.ts.URL+path, body)
	if err != nil {
		e.t.Fatal(err)
	}
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := e.ts.Client().Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	return resp, data
}

func TestHealthInitEnvsMetrics(t *testing.T) {
	e := newEnv(t, false)
	if resp, _ := e.do("GET", "/health", nil, nil); resp.StatusCode != http.StatusNoContent {
		t.Fatalf("health %d", resp.StatusCode)
	}
	init := `{"envVars":{"A":"1"},"defaultUser":"root","defaultWorkdir":"/tmp","timestamp":"2020-01-01T00:00:00Z","volumeMounts":[]}`
	if resp, body := e.do("POST", "/init", strings.NewReader(init), nil); resp.StatusCode != http.StatusNoContent {
		t.Fatalf("init %d %s", resp.StatusCode, body)
	}
	if e.srv.State.DefaultUser() != "root" || e.srv.State.DefaultWorkdir() != "/tmp" {
		t.Fatal("init did not set defaults")
	}
	resp, body := e.do("GET", "/envs", nil, nil)
	var envs map[string]string
	if err := json.Unmarshal(body, &envs); err != nil || resp.StatusCode != 200 || envs["A"] != "1" {
		t.Fatalf("envs %d %s", resp.StatusCode, body)
	}
	resp, body = e.do("GET", "/metrics", nil, nil)
	var m map[string]any
	if err := json.Unmarshal(body, &m); err != nil || resp.StatusCode != 200 {
		t.Fatalf("metrics %d %s", resp.StatusCode, body)
	}
	for _, k := range []string{"ts", "cpu_count", "cpu_used_pct", "mem_total", "mem_used", "mem_cache", "disk_used", "disk_total"} {
		if _, ok := m[k]; !ok {
			t.Fatalf("metrics lacks %s: %s", k, body)
		}
	}
	// Outside gVisor every figure is real: memory and disk in use are never 0, and a
	// busy loop between two samples makes the CPU share positive.
	for _, k := range []string{"cpu_count", "mem_total", "mem_used", "disk_used", "disk_total"} {
		if v, _ := m[k].(float64); v <= 0 {
			t.Fatalf("metrics %s = %v: %s", k, m[k], body)
		}
	}
	if m["mem_used"].(float64) > m["mem_total"].(float64) || m["disk_used"].(float64) > m["disk_total"].(float64) {
		t.Fatalf("used above total: %s", body)
	}
	stop := time.Now().Add(300 * time.Millisecond)
	for x := 0; time.Now().Before(stop); x++ {
	}
	_, body = e.do("GET", "/metrics", nil, nil)
	if err := json.Unmarshal(body, &m); err != nil || m["cpu_used_pct"].(float64) <= 0 {
		t.Fatalf("cpu_used_pct after a busy loop: %s", body)
	}
	if resp, _ := e.do("POST", "/init", strings.NewReader("{bad"), nil); resp.StatusCode != http.StatusBadRequest {
		t.Fatalf("bad init %d", resp.StatusCode)
	}
}

func TestFilesUploadDownload(t *testing.T) {
	e := newEnv(t, false)
	// Raw body, relative path, parents created.
	resp, body := e.do("POST", "/files?path=up/raw.bin", strings.NewReader("raw-data"),
		map[string]string{"Content-Type": "application/octet-stream"})
	var infos []httpapi.WriteInfo
	if err := json.Unmarshal(body, &infos); err != nil || resp.StatusCode != 200 || len(infos) != 1 ||
		infos[0].Path != filepath.Join(e.home, "up/raw.bin") || infos[0].Type != "file" || infos[0].Name != "raw.bin" {
		t.Fatalf("raw upload %d %s", resp.StatusCode, body)
	}
	if got, _ := os.ReadFile(filepath.Join(e.home, "up/raw.bin")); string(got) != "raw-data" {
		t.Fatalf("raw content %q", got)
	}

	// Multipart with several files; the part filename carries the path.
	var mp bytes.Buffer
	mw := multipart.NewWriter(&mp)
	for name, content := range map[string]string{"/tmp/../" + e.home[1:] + "/m/one.txt": "1", "m/two/two.txt": "22"} {
		fw, _ := mw.CreateFormFile("file", name)
		_, _ = fw.Write([]byte(content))
	}
	_ = mw.Close()
	resp, body = e.do("POST", "/files", &mp, map[string]string{"Content-Type": mw.FormDataContentType()})
	if err := json.Unmarshal(body, &infos); err != nil || resp.StatusCode != 200 || len(infos) != 2 {
		t.Fatalf("multipart upload %d %s", resp.StatusCode, body)
	}
	if got, _ := os.ReadFile(filepath.Join(e.home, "m/two/two.txt")); string(got) != "22" {
		t.Fatalf("multipart content %q", got)
	}

	// Gzip upload and download.
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	_, _ = zw.Write([]byte(strings.Repeat("z", 10000)))
	_ = zw.Close()
	resp, body = e.do("POST", "/files?path=gz.txt", &gz, map[string]string{"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
	if resp.StatusCode != 200 {
		t.Fatalf("gzip upload %d %s", resp.StatusCode, body)
	}
	req, _ := http.NewRequest("GET", e.ts.URL+"/files?path=gz.txt", nil)
	req.Header.Set("Accept-Encoding", "gzip")
	gresp, err := (&http.Client{Transport: &http.Transport{DisableCompression: true}}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	zr, err := gzip.NewReader(gresp.Body)
	if err != nil || gresp.Header.Get("Content-Encoding") != "gzip" {
		t.Fatalf("gzip download: %v %v", err, gresp.Header)
	}
	data, _ := io.ReadAll(zr)
	gresp.Body.Close()
	if len(data) != 10000 {
		t.Fatalf("gzip download %d bytes", len(data))
	}

	// Plain download, errors.
	if resp, body := e.do("GET", "/files?path="+url.QueryEscape("~/up/raw.bin"), nil, nil); resp.StatusCode != 200 || string(body) != "raw-data" {
		t.Fatalf("download %d %q", resp.StatusCode, body)
	}
	resp, body = e.do("GET", "/files?path=/no/such/file", nil, nil)
	var eb struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	}
	if json.Unmarshal(body, &eb); resp.StatusCode != 404 || eb.Code != 404 || eb.Message == "" {
		t.Fatalf("missing download %d %s", resp.StatusCode, body)
	}
	if resp, _ := e.do("GET", "/files?path=up", nil, nil); resp.StatusCode != 400 {
		t.Fatalf("directory download %d", resp.StatusCode)
	}
	if resp, _ := e.do("GET", "/files?path=up/raw.bin&username=ghost", nil, nil); resp.StatusCode != 401 {
		t.Fatalf("unknown user %d", resp.StatusCode)
	}
	if resp, _ := e.do("POST", "/files?path=up", strings.NewReader("x"), map[string]string{"Content-Type": "application/octet-stream"}); resp.StatusCode != 400 {
		t.Fatalf("upload onto a directory %d", resp.StatusCode)
	}
	if resp, _ := e.do("POST", "/files?path=x", strings.NewReader("x"), map[string]string{"Content-Type": "text/plain"}); resp.StatusCode != 400 {
		t.Fatalf("bad content type %d", resp.StatusCode)
	}
}

func TestAccessToken(t *testing.T) {
	e := newEnv(t, false)
	if resp, _ := e.do("POST", "/init", strings.NewReader(`{"accessToken":"secret"}`), nil); resp.StatusCode != 204 {
		t.Fatalf("init %d", resp.StatusCode)
	}
	if resp, _ := e.do("GET", "/health", nil, nil); resp.StatusCode != 204 {
		t.Fatalf("health needs no token: %d", resp.StatusCode)
	}
	for _, path := range []string{"/envs", "/metrics", "/files?path=x"} {
		if resp, _ := e.do("GET", path, nil, nil); resp.StatusCode != 401 {
			t.Fatalf("%s without token: %d", path, resp.StatusCode)
		}
		if resp, _ := e.do("GET", path, nil, map[string]string{"X-Access-Token": "wrong"}); resp.StatusCode != 401 {
			t.Fatalf("%s with wrong token: %d", path, resp.StatusCode)
		}
	}
	if resp, _ := e.do("GET", "/envs", nil, map[string]string{"X-Access-Token": "secret"}); resp.StatusCode != 200 {
		t.Fatalf("envs with token: %d", resp.StatusCode)
	}
	// Changing the token needs the current one.
	if resp, _ := e.do("POST", "/init", strings.NewReader(`{"accessToken":"other"}`), nil); resp.StatusCode != 401 {
		t.Fatalf("re-init without token: %d", resp.StatusCode)
	}

	// RPCs without the token fail as unauthenticated.
	_, err := e.proc.List(context.Background(), connect.NewRequest(&rpc.ListRequest{}))
	if codeOf(err) != connect.CodeUnauthenticated {
		t.Fatalf("rpc without token: %v", err)
	}
	req := connect.NewRequest(&rpc.ListRequest{})
	req.Header().Set("X-Access-Token", "secret")
	if _, err := e.proc.List(context.Background(), req); err != nil {
		t.Fatalf("rpc with token: %v", err)
	}

	// Signed file URLs (SDK's v1 signature) work without the header.
	if err := os.WriteFile(filepath.Join(e.home, "s.txt"), []byte("signed"), 0o644); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256([]byte("s.txt:read::secret"))
	sig := "v1_" + base64.RawStdEncoding.EncodeToString(sum[:])
	if resp, body := e.do("GET", "/files?path=s.txt&signature="+url.QueryEscape(sig), nil, nil); resp.StatusCode != 200 || string(body) != "signed" {
		t.Fatalf("signed download %d %s", resp.StatusCode, body)
	}
	if resp, _ := e.do("GET", "/files?path=s.txt&signature=v1_bogus", nil, nil); resp.StatusCode != 401 {
		t.Fatalf("bad signature %d", resp.StatusCode)
	}
}
