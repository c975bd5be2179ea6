// Package server wires envd's services into one http.Handler and
// http.Server (HTTP/1.1 and h2c on the same port).
package server

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"runtime/debug"
	"time"

	"connectrpc.com/connect"

	"forkyard/envd/internal/filesystem"
	"forkyard/envd/internal/httpapi"
	"forkyard/envd/internal/process"
	"forkyard/envd/internal/reaper"
	"forkyard/envd/internal/state"
)

// IdleTimeout outlives the proxies' idle timeouts in front of envd.
const IdleTimeout = 640 * time.Second

// Options configure a Server.
type Options struct {
	SetClock bool // let POST /init set the system clock
	Verbose  bool // log every request
	Logf     func(format string, args ...any)
}

// Server is envd's HTTP front: Connect services, the plain HTTP API and
// the access-token check.
type Server struct {
	State      *state.State
	Processes  *process.Service
	Filesystem *filesystem.Service
	API        *httpapi.API
	Handler    http.Handler
}

// New builds the handler tree over st, starting processes through rp.
func New(st *state.State, rp *reaper.Reaper, opts Options) *Server {
	s := &Server{
		State:      st,
		Processes:  process.New(st, rp),
		Filesystem: filesystem.New(st),
		API:        httpapi.New(st),
	}
	s.API.SetClock = opts.SetClock
	s.API.Logf = opts.Logf

	// A panic in a handler becomes an internal error, never a crash.
	recov := connect.WithRecover(func(_ context.Context, spec connect.Spec, _ http.Header, p any) error {
		if opts.Logf != nil {
			opts.Logf("panic in %s: %v\n%s", spec.Procedure, p, debug.Stack())
		}
		return connect.NewError(connect.CodeInternal, fmt.Errorf("internal error in %s", spec.Procedure))
	})
	mux := http.NewServeMux()
	s.API.Register(mux)
	mux.Handle(s.Processes.Handler(recov))
	mux.Handle(s.Filesystem.Handler(recov))

	var h http.Handler = s.API.WithAuth(mux)
	h = withCORS(h)
	if opts.Verbose {
		h = withLog(h, opts.Logf)
	}
	s.Handler = h
	return s
}

// HTTPServer returns an http.Server serving HTTP/1.1 and h2c (HTTP/2 with
// prior knowledge, no TLS) on the same listener. There are no read/write
// timeouts: streams live as long as their commands or watches.
func (s *Server) HTTPServer(errorLog *log.Logger) *http.Server {
	protocols := new(http.Protocols)
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true)
	return &http.Server{
		Handler:           s.Handler,
		Protocols:         protocols,
		IdleTimeout:       IdleTimeout,
		ReadHeaderTimeout: 30 * time.Second,
		ErrorLog:          errorLog,
	}
}

// withCORS answers browser preflights and lets browsers read Connect's
// headers, as E2B's envd does for the JS SDK.
func withCORS(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Origin") == "" {
			h.ServeHTTP(w, r)
			return
		}
		hd := w.Header()
		hd.Set("Access-Control-Allow-Origin", "*")
		hd.Set("Access-Control-Expose-Headers", "Grpc-Status, Grpc-Message, Grpc-Status-Details-Bin, Connect-Protocol-Version, Location, Cache-Control, X-Content-Type-Options, Content-Encoding, Content-Disposition")
		if r.Method == http.MethodOptions && r.Header.Get("Access-Control-Request-Method") != "" {
			hd.Set("Access-Control-Allow-Methods", "HEAD, GET, POST, PUT, PATCH, DELETE")
			if req := r.Header.Get("Access-Control-Request-Headers"); req != "" {
				hd.Set("Access-Control-Allow-Headers", req)
			}
			hd.Set("Access-Control-Max-Age", "7200")
			w.WriteHeader(http.StatusNoContent)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// withLog logs each request after it completes.
func withLog(h http.Handler, logf func(string, ...any)) http.Handler {
	if logf == nil {
		logf = log.Printf
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		h.ServeHTTP(w, r)
		logf("%s %s %s %v", r.Proto, r.Method, r.URL.Path, time.Since(start).Round(time.Microsecond))
	})
}
