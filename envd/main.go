// Command envd is the in-sandbox agent of forkyard. It runs as PID 1 of every
// sandbox and speaks E2B's envd protocol: the process.Process and
// filesystem.Filesystem Connect services plus the plain HTTP endpoints
// /health, /init, /envs, /metrics and /files, all on one port.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"forkyard/envd/internal/filesystem"
	"forkyard/envd/internal/httpapi"
	"forkyard/envd/internal/identity"
	"forkyard/envd/internal/process"
	"forkyard/envd/internal/reaper"
	"forkyard/envd/internal/state"
)

const (
	defaultPort = 49983
	// idleTimeout outlives the proxies' idle timeouts in front of envd.
	idleTimeout = 640 * time.Second
	// stopGrace is how long processes get between SIGTERM and SIGKILL when
	// envd itself is asked to stop.
	stopGrace = 5 * time.Second
)

func main() {
	var (
		port        = flag.Int("port", defaultPort, "TCP port to serve on")
		listen      = flag.String("listen", "0.0.0.0", "address to listen on")
		defaultUser = flag.String("default-user", "user", "user commands and file operations run as when the request names none (POST /init defaultUser overrides; falls back to root when missing from /etc/passwd)")
		setClock    = flag.Bool("set-clock", false, "let POST /init set the system clock from its timestamp")
		verbose     = flag.Bool("verbose", false, "log every request")
		showVersion = flag.Bool("version", false, "print the envd protocol version and exit")
	)
	flag.Parse()
	if *showVersion {
		fmt.Println(state.Version)
		return
	}
	log.SetFlags(log.LstdFlags | log.Lmicroseconds)
	log.SetPrefix("envd: ")

	// Signals: SIGCHLD belongs to the reaper; SIGPIPE and SIGHUP are
	// observed (not ignored, so children keep default dispositions).
	rp := reaper.New()
	stop := make(chan os.Signal, 2)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	misc := make(chan os.Signal, 8)
	signal.Notify(misc, syscall.SIGPIPE, syscall.SIGHUP)
	go func() {
		for range misc {
		}
	}()

	st := state.New(identity.DB{}, *defaultUser)
	st.SetEnv(map[string]string{"E2B_SANDBOX": "true"})
	if _, err := st.Users.Lookup(*defaultUser); err != nil {
		log.Printf("default user %q not found (%v); using root until /init sets one", *defaultUser, err)
	}

	procs := process.New(st, rp)
	files := filesystem.New(st)
	api := httpapi.New(st)
	api.SetClock = *setClock
	api.Logf = log.Printf

	mux := http.NewServeMux()
	api.Register(mux)
	mux.Handle(procs.Handler())
	mux.Handle(files.Handler())

	var handler http.Handler = api.WithAuth(mux)
	handler = withCORS(handler)
	if *verbose {
		handler = withLog(handler)
	}

	protocols := new(http.Protocols)
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true) // h2c with prior knowledge
	srv := &http.Server{
		Handler:           handler,
		Protocols:         protocols,
		IdleTimeout:       idleTimeout,
		ReadHeaderTimeout: 30 * time.Second,
		ErrorLog:          log.Default(),
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(*listen, fmt.Sprint(*port)))
	if err != nil {
		log.Fatalf("listen: %v", err)
	}
	log.Printf("version %s listening on %s (pid %d)", state.Version, ln.Addr(), os.Getpid())

	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()

	select {
	case err := <-served:
		log.Printf("server stopped: %v", err)
	case sig := <-stop:
		log.Printf("%v: stopping", sig)
	}
	shutdown(srv, procs, files, rp)
}

// shutdown stops accepting requests, asks every process to terminate,
// kills what is left after stopGrace and closes the remaining streams.
func shutdown(srv *http.Server, procs *process.Service, files *filesystem.Service, rp *reaper.Reaper) {
	files.Close()
	procs.Shutdown(syscall.SIGTERM)
	ctx, cancel := context.WithTimeout(context.Background(), stopGrace)
	defer cancel()
	done := make(chan struct{})
	go func() {
		_ = srv.Shutdown(ctx)
		close(done)
	}()
	deadline := time.Now().Add(stopGrace)
	for procs.Running() > 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if procs.Running() > 0 {
		procs.Shutdown(syscall.SIGKILL)
		time.Sleep(100 * time.Millisecond)
	}
	select {
	case <-done:
	case <-time.After(time.Second):
		_ = srv.Close()
	}
	rp.Close()
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
func withLog(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		h.ServeHTTP(w, r)
		log.Printf("%s %s %s %v", r.Proto, r.Method, r.URL.Path, time.Since(start).Round(time.Microsecond))
	})
}
