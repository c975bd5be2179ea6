// Package httpapi serves envd's plain HTTP endpoints (/health, /init,
// /envs, /metrics, /files) and the access-token check wrapped around every
// route, the Connect services included.
package httpapi

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"forkyard/envd/internal/state"
)

// AccessTokenHeader carries the sandbox access token.
const AccessTokenHeader = "X-Access-Token"

// API serves the plain HTTP endpoints.
type API struct {
	st      *state.State
	metrics *metricsSampler
	// Logf logs operational messages; nil discards them.
	Logf func(format string, args ...any)
	// SetClock lets POST /init set the system clock from its timestamp.
	// Off by default: under gVisor the sandbox clock follows the host's, and
	// envd must never move a development host's clock.
	SetClock bool
}

// New returns an API over st.
func New(st *state.State) *API {
	return &API{st: st, metrics: newMetricsSampler()}
}

func (a *API) logf(format string, args ...any) {
	if a.Logf != nil {
		a.Logf(format, args...)
	}
}

// Register adds the HTTP routes to mux.
func (a *API) Register(mux *http.ServeMux) {
	mux.HandleFunc("GET /health", a.health)
	mux.HandleFunc("POST /init", a.init)
	mux.HandleFunc("GET /envs", a.envs)
	mux.HandleFunc("GET /metrics", a.getMetrics)
	mux.HandleFunc("GET /files", a.download)
	mux.HandleFunc("POST /files", a.upload)
}

type errorBody struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

// jsonError writes E2B's error body: {"code": status, "message": ...}.
func jsonError(w http.ResponseWriter, status int, err error) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(errorBody{Code: status, Message: err.Error()})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func (a *API) health(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("Content-Type", "")
	w.WriteHeader(http.StatusNoContent)
}

// InitRequest is the body of POST /init (E2B's schema; unknown fields such
// as volumeMounts or hyperloopIP are accepted and ignored).
type InitRequest struct {
	EnvVars        map[string]string `json:"envVars,omitempty"`
	AccessToken    *string           `json:"accessToken,omitempty"`
	Timestamp      *time.Time        `json:"timestamp,omitempty"`
	DefaultUser    *string           `json:"defaultUser,omitempty"`
	DefaultWorkdir *string           `json:"defaultWorkdir,omitempty"`
}

func (a *API) init(w http.ResponseWriter, r *http.Request) {
	var req InitRequest
	body, err := io.ReadAll(io.LimitReader(r.Body, 8<<20))
	if err != nil {
		jsonError(w, http.StatusBadRequest, fmt.Errorf("reading body: %w", err))
		return
	}
	if len(strings.TrimSpace(string(body))) > 0 {
		if err := json.Unmarshal(body, &req); err != nil {
			jsonError(w, http.StatusBadRequest, fmt.Errorf("decoding body: %w", err))
			return
		}
	}
	if req.EnvVars != nil {
		a.st.SetEnv(req.EnvVars)
	}
	if req.DefaultUser != nil && *req.DefaultUser != "" {
		a.st.SetDefaultUser(*req.DefaultUser)
	}
	if req.DefaultWorkdir != nil {
		a.st.SetDefaultWorkdir(*req.DefaultWorkdir)
	}
	if req.AccessToken != nil {
		// The auth middleware already checked that a caller changing an
		// existing token presented it.
		a.st.SetAccessToken(*req.AccessToken)
	}
	if req.Timestamp != nil && a.SetClock {
		setClock(*req.Timestamp, a.logf)
	}
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("Content-Type", "")
	w.WriteHeader(http.StatusNoContent)
}

func (a *API) envs(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, a.st.Env())
}

// errExpiredSignature is E2B envd's answer (401) to a URL whose signature is
// valid but whose signature_expiration has passed (the SDKs' own tests match
// the text).
var errExpiredSignature = errors.New("signature is already expired")

// checkSignature reports whether the request carries a valid, unexpired v1
// file-URL signature (see the SDK's e2b/sandbox/signature.py) for operation.
// The signature is compared first: only a URL signed with this sandbox's token
// learns that its expiry was the problem (errExpiredSignature); any other
// failure is (false, nil).
func (a *API) checkSignature(r *http.Request, operation string) (bool, error) {
	q := r.URL.Query()
	sig := q.Get("signature")
	tok := a.st.AccessToken()
	if sig == "" || tok == "" {
		return false, nil
	}
	parts := []string{q.Get("path"), operation, q.Get("username"), tok}
	var expires int64
	exp := q.Get("signature_expiration")
	if exp != "" {
		n, err := strconv.ParseInt(exp, 10, 64)
		if err != nil {
			return false, nil
		}
		expires = n
		parts = append(parts, exp)
	}
	sum := sha256.Sum256([]byte(strings.Join(parts, ":")))
	want := "v1_" + base64.RawStdEncoding.EncodeToString(sum[:])
	if subtle.ConstantTimeCompare([]byte(want), []byte(sig)) != 1 {
		return false, nil
	}
	if exp != "" && expires < time.Now().Unix() {
		return false, errExpiredSignature
	}
	return true, nil
}

// WithAuth wraps h with the access-token check: once a token is set, every
// request but GET /health needs a matching X-Access-Token header; /files
// also accepts a valid URL signature instead.
func (a *API) WithAuth(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if a.st.AccessToken() == "" || (r.Method == http.MethodGet && r.URL.Path == "/health") {
			h.ServeHTTP(w, r)
			return
		}
		if a.st.TokenMatches(r.Header.Get(AccessTokenHeader)) {
			h.ServeHTTP(w, r)
			return
		}
		if r.URL.Path == "/files" && r.Header.Get(AccessTokenHeader) == "" {
			op := "read"
			if r.Method == http.MethodPost {
				op = "write"
			}
			ok, err := a.checkSignature(r, op)
			if ok {
				h.ServeHTTP(w, r)
				return
			}
			if err != nil {
				jsonError(w, http.StatusUnauthorized, err)
				return
			}
		}
		jsonError(w, http.StatusUnauthorized, errors.New("unauthorized access, please provide a valid access token or method signing if supported"))
	})
}
