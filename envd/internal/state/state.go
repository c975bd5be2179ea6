// Package state holds envd's mutable, sandbox-wide settings: the env vars,
// default user and workdir set by POST /init, and the access token.
package state

import (
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"fmt"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"unicode/utf8"

	"forkyard/envd/internal/identity"
)

// Version is the E2B envd version envd is wire-compatible with. The SDK
// gates features on it (see e2b/envd/versions.py).
const Version = "0.6.4"

// State is safe for concurrent use.
type State struct {
	Users identity.DB

	mu             sync.RWMutex
	envVars        map[string]string
	defaultUser    string
	defaultWorkdir string
	accessToken    string
}

// New returns a State whose default user is defaultUser.
func New(users identity.DB, defaultUser string) *State {
	return &State{Users: users, envVars: map[string]string{}, defaultUser: defaultUser}
}

// SetEnv merges vars into the sandbox-wide environment.
func (s *State) SetEnv(vars map[string]string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for k, v := range vars {
		s.envVars[k] = v
	}
}

// Env returns a copy of the sandbox-wide environment.
func (s *State) Env() map[string]string {
	s.mu.RLock()
	defer s.mu.RUnlock()
	out := make(map[string]string, len(s.envVars))
	for k, v := range s.envVars {
		out[k] = v
	}
	return out
}

// EnvList returns the sandbox-wide environment as sorted KEY=VALUE strings.
func (s *State) EnvList() []string {
	env := s.Env()
	out := make([]string, 0, len(env))
	for k, v := range env {
		out = append(out, k+"="+v)
	}
	sort.Strings(out)
	return out
}

// SetDefaultUser changes the user operations run as when none is given.
func (s *State) SetDefaultUser(u string) {
	s.mu.Lock()
	s.defaultUser = u
	s.mu.Unlock()
}

// DefaultUser returns the user operations run as when none is given.
func (s *State) DefaultUser() string {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.defaultUser
}

// SetDefaultWorkdir changes the directory relative paths and commands start
// from when none is given ("" means the user's home).
func (s *State) SetDefaultWorkdir(d string) {
	s.mu.Lock()
	s.defaultWorkdir = d
	s.mu.Unlock()
}

// DefaultWorkdir returns the default working directory ("" = user's home).
func (s *State) DefaultWorkdir() string {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.defaultWorkdir
}

// SetAccessToken sets (or with "" clears) the access token.
func (s *State) SetAccessToken(t string) {
	s.mu.Lock()
	s.accessToken = t
	s.mu.Unlock()
}

// AccessToken returns the access token ("" when envd is unsecured).
func (s *State) AccessToken() string {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.accessToken
}

// TokenMatches reports whether t equals the access token, in constant time.
// It is false when no token is set.
func (s *State) TokenMatches(t string) bool {
	tok := s.AccessToken()
	if tok == "" {
		return false
	}
	return subtle.ConstantTimeCompare([]byte(tok), []byte(t)) == 1
}

// ResolveUser returns the named user, or the default user when name is "".
// When the default user is missing from /etc/passwd, root is used instead so
// a rootfs without the conventional "user" account still works.
func (s *State) ResolveUser(name string) (*identity.User, error) {
	if name != "" {
		return s.Users.Lookup(name)
	}
	def := s.DefaultUser()
	u, err := s.Users.Lookup(def)
	if err != nil && errors.Is(err, identity.ErrUnknownUser) && def != "root" {
		return s.Users.Lookup("root")
	}
	return u, err
}

// ErrInvalidUTF8 is returned for paths that are not valid UTF-8: E2B's API
// carries paths as strings, so such a name could never be listed back faithfully.
var ErrInvalidUTF8 = errors.New("path is not valid UTF-8")

// ErrHomeExpansion is returned for "~name" paths, which are not supported.
var ErrHomeExpansion = errors.New("cannot expand user-specific home dir")

// ResolvePath turns a request path into an absolute, cleaned path for user
// u: "" means the default workdir (or home), "~" and "~/x" expand to the
// home directory and relative paths are taken from the home directory.
func (s *State) ResolvePath(p string, u *identity.User) (string, error) {
	if !utf8.ValidString(p) {
		return "", ErrInvalidUTF8
	}
	if p == "" {
		p = s.DefaultWorkdir()
	}
	if strings.HasPrefix(p, "~") {
		if len(p) > 1 && p[1] != '/' {
			return "", fmt.Errorf("%w: %q", ErrHomeExpansion, p)
		}
		p = filepath.Join(u.Home, p[1:])
	}
	if !filepath.IsAbs(p) {
		p = filepath.Join(u.Home, p)
	}
	return filepath.Clean(p), nil
}

// BasicAuthUser extracts the user name from an "Authorization: Basic
// base64(user:)" header value, the way the E2B SDK passes the user. ok is
// false when the header is absent or not Basic.
func BasicAuthUser(header string) (name string, ok bool) {
	const prefix = "Basic "
	if len(header) < len(prefix) || !strings.EqualFold(header[:len(prefix)], prefix) {
		return "", false
	}
	raw, err := base64.StdEncoding.DecodeString(strings.TrimSpace(header[len(prefix):]))
	if err != nil {
		return "", false
	}
	name, _, _ = strings.Cut(string(raw), ":")
	return name, true
}
