package httpapi

import (
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"mime"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"forkyard/envd/internal/fsutil"
	"forkyard/envd/internal/identity"
)

// metadataHeaderPrefix marks upload headers carrying file metadata.
const metadataHeaderPrefix = "X-Metadata-"

// copyBufferSize is the buffer for streaming uploads to disk.
const copyBufferSize = 256 << 10

// WriteInfo is one entry of a /files upload response.
type WriteInfo struct {
	Name     string            `json:"name"`
	Type     string            `json:"type"`
	Path     string            `json:"path"`
	Metadata map[string]string `json:"metadata,omitempty"`
}

// fileUser resolves the username query parameter (default user when empty).
func (a *API) fileUser(w http.ResponseWriter, r *http.Request) (*identity.User, bool) {
	name := r.URL.Query().Get("username")
	u, err := a.st.ResolveUser(name)
	if err != nil {
		if errors.Is(err, identity.ErrUnknownUser) {
			jsonError(w, http.StatusUnauthorized, fmt.Errorf("error looking up user '%s': %w", name, err))
		} else {
			jsonError(w, http.StatusInternalServerError, err)
		}
		return nil, false
	}
	return u, true
}

func (a *API) resolve(w http.ResponseWriter, p string, u *identity.User) (string, bool) {
	if strings.ContainsRune(p, 0) {
		jsonError(w, http.StatusBadRequest, errors.New("path contains a NUL byte"))
		return "", false
	}
	abs, err := a.st.ResolvePath(p, u)
	if err != nil {
		jsonError(w, http.StatusBadRequest, fmt.Errorf("error resolving path '%s': %w", p, err))
		return "", false
	}
	return abs, true
}

// statusFor maps a filesystem error to an HTTP status.
func statusFor(err error) int {
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return http.StatusNotFound
	case errors.Is(err, fs.ErrPermission), errors.Is(err, syscall.EROFS):
		return http.StatusForbidden
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		return http.StatusInsufficientStorage
	case errors.Is(err, syscall.ENOTDIR), errors.Is(err, syscall.EISDIR),
		errors.Is(err, syscall.ENAMETOOLONG), errors.Is(err, syscall.EINVAL):
		return http.StatusBadRequest
	}
	return http.StatusInternalServerError
}

func acceptsGzip(r *http.Request) bool {
	for _, part := range strings.Split(r.Header.Get("Accept-Encoding"), ",") {
		enc, params, _ := strings.Cut(strings.TrimSpace(part), ";")
		if strings.EqualFold(strings.TrimSpace(enc), "gzip") && !strings.Contains(strings.ReplaceAll(params, " ", ""), "q=0") {
			return true
		}
	}
	return false
}

func (a *API) download(w http.ResponseWriter, r *http.Request) {
	u, ok := a.fileUser(w, r)
	if !ok {
		return
	}
	p, ok := a.resolve(w, r.URL.Query().Get("path"), u)
	if !ok {
		return
	}
	var f *os.File
	err := identity.AsUser(u, func() (err error) { // with exactly u's permissions
		f, err = os.Open(p)
		return err
	})
	if err != nil {
		jsonError(w, statusFor(err), fmt.Errorf("error opening '%s': %w", p, err))
		return
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		jsonError(w, statusFor(err), fmt.Errorf("error checking '%s': %w", p, err))
		return
	}
	if st.IsDir() {
		jsonError(w, http.StatusBadRequest, fmt.Errorf("path '%s' is a directory", p))
		return
	}
	w.Header().Set("Vary", "Accept-Encoding")
	plainOnly := r.Header.Get("Range") != "" || r.Header.Get("If-Range") != "" ||
		r.Header.Get("If-Modified-Since") != "" || r.Header.Get("If-None-Match") != ""
	if acceptsGzip(r) && !plainOnly {
		ct := mime.TypeByExtension(filepath.Ext(p))
		if ct == "" {
			ct = "application/octet-stream"
		}
		w.Header().Set("Content-Type", ct)
		w.Header().Set("Content-Encoding", "gzip")
		gw, _ := gzip.NewWriterLevel(w, gzip.BestSpeed)
		if _, err := io.Copy(gw, f); err != nil {
			a.logf("envd: download %s: %v", p, err)
		}
		_ = gw.Close()
		return
	}
	// ServeContent streams (sendfile over HTTP/1.1) and handles Range.
	http.ServeContent(w, r, filepath.Base(p), st.ModTime(), f)
}

// uploadMetadata collects X-Metadata-<key> headers (keys lower-cased, since
// HTTP header names are case-insensitive).
func uploadMetadata(h http.Header) map[string]string {
	var md map[string]string
	for k, v := range h {
		if len(k) > len(metadataHeaderPrefix) && strings.EqualFold(k[:len(metadataHeaderPrefix)], metadataHeaderPrefix) && len(v) > 0 {
			if md == nil {
				md = map[string]string{}
			}
			md[strings.ToLower(k[len(metadataHeaderPrefix):])] = v[0]
		}
	}
	return md
}

// writeFile streams src into path (parents created and owned by u) with
// exactly u's permissions (identity.AsUser): a user cannot write where it
// could not write itself.
func writeFile(path string, src io.Reader, u *identity.User, md map[string]string) (code int, err error) {
	if aerr := identity.AsUser(u, func() error {
		code, err = writeFileAs(path, src, u, md)
		return nil
	}); aerr != nil {
		return http.StatusInternalServerError, fmt.Errorf("switching to user %s: %w", u.Name, aerr)
	}
	return code, err
}

func writeFileAs(path string, src io.Reader, u *identity.User, md map[string]string) (int, error) {
	if err := fsutil.EnsureDir(filepath.Dir(path), int(u.UID), int(u.GID)); err != nil {
		return statusFor(err), fmt.Errorf("error ensuring directories: %w", err)
	}
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		return http.StatusBadRequest, fmt.Errorf("path is a directory: %s", path)
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return statusFor(err), fmt.Errorf("error opening file: %w", err)
	}
	// Running as u, a file it creates is already its own; root writing for u
	// hands the file over.
	if err := fsutil.Chown(path, int(u.UID), int(u.GID)); err != nil && u.UID == 0 {
		_ = f.Close()
		return statusFor(err), fmt.Errorf("error changing file ownership: %w", err)
	}
	buf := make([]byte, copyBufferSize)
	_, err = io.CopyBuffer(struct{ io.Writer }{f}, src, buf)
	cerr := f.Close()
	if err == nil {
		err = cerr
	}
	if err != nil {
		return statusFor(err), fmt.Errorf("error writing file: %w", err)
	}
	if err := fsutil.ReplaceMetadata(path, md); err != nil {
		return http.StatusInternalServerError, err
	}
	return http.StatusOK, nil
}

func (a *API) upload(w http.ResponseWriter, r *http.Request) {
	u, ok := a.fileUser(w, r)
	if !ok {
		return
	}
	q := r.URL.Query()
	body := io.Reader(r.Body)
	if strings.EqualFold(r.Header.Get("Content-Encoding"), "gzip") {
		gz, err := gzip.NewReader(r.Body)
		if err != nil {
			jsonError(w, http.StatusBadRequest, fmt.Errorf("error decompressing request body: %w", err))
			return
		}
		defer gz.Close()
		body = gz
	}
	md := uploadMetadata(r.Header)
	mediaType, params, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))

	var written []WriteInfo
	add := func(p string) {
		written = append(written, WriteInfo{Name: filepath.Base(p), Type: "file", Path: p, Metadata: md})
	}
	switch {
	case mediaType == "application/octet-stream":
		if !q.Has("path") {
			jsonError(w, http.StatusBadRequest, errors.New("path query parameter is required for raw body upload"))
			return
		}
		p, ok := a.resolve(w, q.Get("path"), u)
		if !ok {
			return
		}
		if status, err := writeFile(p, body, u, md); err != nil {
			jsonError(w, status, err)
			return
		}
		add(p)
	case strings.HasPrefix(mediaType, "multipart/"):
		boundary := params["boundary"]
		if boundary == "" {
			jsonError(w, http.StatusBadRequest, errors.New("multipart body without boundary"))
			return
		}
		mr := newMultipartReader(body, boundary)
		seen := map[string]bool{}
		for {
			part, err := mr.NextPart()
			if err == io.EOF {
				break
			}
			if err != nil {
				jsonError(w, http.StatusBadRequest, fmt.Errorf("error reading form: %w", err))
				return
			}
			if part.FormName() != "file" {
				_ = part.Close()
				continue
			}
			target := q.Get("path")
			if !q.Has("path") {
				target = partFileName(part)
			}
			p, ok := a.resolve(w, target, u)
			if !ok {
				return
			}
			if seen[p] {
				jsonError(w, http.StatusBadRequest, fmt.Errorf("you cannot upload multiple files to the same path '%s' in one upload request", p))
				return
			}
			seen[p] = true
			status, err := writeFile(p, part, u, md)
			_ = part.Close()
			if err != nil {
				jsonError(w, status, err)
				return
			}
			add(p)
		}
	default:
		jsonError(w, http.StatusBadRequest, fmt.Errorf("unsupported content type: %q, expected multipart/form-data or application/octet-stream", r.Header.Get("Content-Type")))
		return
	}
	if written == nil {
		written = []WriteInfo{}
	}
	writeJSON(w, http.StatusOK, written)
}
