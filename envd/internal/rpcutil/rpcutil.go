// Package rpcutil holds request helpers shared by envd's Connect services:
// resolving the calling user and the keepalive interval of streams.
package rpcutil

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"connectrpc.com/connect"

	"forkyard/envd/internal/identity"
	"forkyard/envd/internal/state"
)

// KeepaliveHeader carries the keepalive interval in seconds the SDK wants on
// long-lived streams.
const KeepaliveHeader = "Keepalive-Ping-Interval"

// AuthUser resolves the user of an RPC from its "Authorization: Basic
// base64(user:)" header, falling back to the default user. Errors are
// Connect errors (unauthenticated for unknown users, as E2B's envd does).
func AuthUser(st *state.State, h http.Header) (*identity.User, error) {
	name, ok := state.BasicAuthUser(h.Get("Authorization"))
	if ok && name == "" {
		ok = false
	}
	u, err := st.ResolveUser(name)
	if err != nil {
		if errors.Is(err, identity.ErrUnknownUser) {
			if ok {
				return nil, connect.NewError(connect.CodeUnauthenticated, fmt.Errorf("invalid username: '%s'", name))
			}
			return nil, connect.NewError(connect.CodeUnauthenticated, fmt.Errorf("invalid default user: '%s'", st.DefaultUser()))
		}
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	return u, nil
}

// KeepaliveInterval parses the Keepalive-Ping-Interval header (seconds);
// 0 means no keepalives.
func KeepaliveInterval(h http.Header) time.Duration {
	v := h.Get(KeepaliveHeader)
	if v == "" {
		return 0
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		return 0
	}
	return time.Duration(n) * time.Second
}

// Keepalive is a resettable keepalive timer for a stream.
type Keepalive struct {
	t *time.Ticker
	d time.Duration
	// C fires when a keepalive is due; nil (never fires) when disabled.
	C <-chan time.Time
}

// NewKeepalive returns a keepalive ticking every d (disabled when d <= 0).
func NewKeepalive(d time.Duration) *Keepalive {
	k := &Keepalive{d: d}
	if d > 0 {
		k.t = time.NewTicker(d)
		k.C = k.t.C
	}
	return k
}

// Reset postpones the next keepalive by a full interval (after real data).
func (k *Keepalive) Reset() {
	if k.t != nil {
		k.t.Reset(k.d)
	}
}

// Stop releases the ticker.
func (k *Keepalive) Stop() {
	if k.t != nil {
		k.t.Stop()
	}
}
