// Command envd is the in-sandbox agent of forkyard. It runs as PID 1 of every
// sandbox and speaks E2B's envd protocol: the process.Process and
// filesystem.Filesystem Connect services plus the plain HTTP endpoints
// /health, /init, /envs, /metrics and /files, all on one port (HTTP/1.1 and
// h2c).
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"forkyard/envd/internal/identity"
	"forkyard/envd/internal/portfwd"
	"forkyard/envd/internal/reaper"
	"forkyard/envd/internal/server"
	"forkyard/envd/internal/state"
	"forkyard/envd/internal/sudo"
)

const (
	defaultPort = 49983
	// stopGrace is how long processes get between SIGTERM and SIGKILL when
	// envd itself is asked to stop.
	stopGrace = 5 * time.Second
)

func main() {
	// A multi-call binary: images get /usr/bin/sudo and the sudo broker as
	// links to envd (gVisor ignores set-user-ID bits; see internal/sudo).
	switch filepath.Base(os.Args[0]) {
	case "sudo", "sudoedit":
		os.Exit(sudo.Client(filepath.Base(os.Args[0]), os.Args[1:]))
	case "sudo-broker":
		if err := sudo.Broker(); err != nil {
			fmt.Fprintf(os.Stderr, "sudo-broker: %v\n", err)
			os.Exit(1)
		}
		return
	}
	var (
		port        = flag.Int("port", defaultPort, "TCP port to serve on")
		listen      = flag.String("listen", "0.0.0.0", "address to listen on")
		defaultUser = flag.String("default-user", "user", "user commands and file operations run as when the request names none (POST /init defaultUser overrides; falls back to root when missing from /etc/passwd)")
		setClock    = flag.Bool("set-clock", false, "let POST /init set the system clock from its timestamp")
		verbose     = flag.Bool("verbose", false, "log every request")
		showVersion = flag.Bool("version", false, "print the envd protocol version and exit")
		forward     = flag.Bool("forward-localhost", true, "make servers listening only on 127.0.0.1/::1 reachable on the sandbox's own address, as E2B's envd does")
	)
	flag.Parse()
	if *showVersion {
		fmt.Println(state.Version)
		return
	}
	// UTC with microseconds: the host turns these lines into the sandbox logs API.
	log.SetFlags(log.LstdFlags | log.Lmicroseconds | log.LUTC | log.Lmsgprefix)
	log.SetPrefix("envd: ")

	// SIGCHLD belongs to the reaper. SIGPIPE and SIGHUP are observed rather
	// than ignored, so children keep their default dispositions.
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

	s := server.New(st, rp, server.Options{SetClock: *setClock, Verbose: *verbose, Logf: log.Printf})
	srv := s.HTTPServer(log.Default())
	tl, err := net.Listen("tcp", net.JoinHostPort(*listen, fmt.Sprint(*port)))
	if err != nil {
		log.Fatalf("listen: %v", err)
	}
	// SIGUSR1 = "you were just restored from a checkpoint": re-register the
	// listening socket with the poller (see server.RearmListener). The host
	// sends it right after `runsc restore` only with FORKYARD_ENVD_REARM=1
	// (the pinned runsc does not need it; docs/runtime.md).
	ln := server.NewRearmListener(tl.(*net.TCPListener), 0)
	rearm := make(chan os.Signal, 4)
	signal.Notify(rearm, syscall.SIGUSR1)
	go func() {
		for range rearm {
			if err := ln.Rearm(); err != nil {
				log.Printf("rearm listener: %v", err)
			}
		}
	}()
	log.Printf("version %s listening on %s (pid %d)", state.Version, ln.Addr(), os.Getpid())

	fwdCtx, stopFwd := context.WithCancel(context.Background())
	defer stopFwd()
	if *forward {
		fw := portfwd.New()
		fw.Busy = func() bool { return s.Processes.Running() > 0 }
		fw.Logf = log.Printf
		s.Processes.OnStart = fw.Kick
		go fw.Run(fwdCtx)
	}

	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	select {
	case err := <-served:
		log.Printf("server stopped: %v", err)
	case sig := <-stop:
		log.Printf("%v: stopping", sig)
	}

	// Graceful stop: no new requests, SIGTERM to every process, SIGKILL to
	// what is left after stopGrace, then close the remaining streams.
	s.Filesystem.Close()
	s.Processes.Shutdown(syscall.SIGTERM)
	ctx, cancel := context.WithTimeout(context.Background(), stopGrace)
	defer cancel()
	done := make(chan struct{})
	go func() {
		_ = srv.Shutdown(ctx)
		close(done)
	}()
	for deadline := time.Now().Add(stopGrace); s.Processes.Running() > 0 && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
	}
	if s.Processes.Running() > 0 {
		s.Processes.Shutdown(syscall.SIGKILL)
		time.Sleep(100 * time.Millisecond)
	}
	select {
	case <-done:
	case <-time.After(time.Second):
		_ = srv.Close()
	}
	rp.Close()
	log.Printf("stopped")
}
