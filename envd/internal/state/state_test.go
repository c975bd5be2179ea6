package state

import (
	"encoding/base64"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"forkyard/envd/internal/identity"
)

func TestResolvePath(t *testing.T) {
	s := New(identity.DB{}, "user")
	u := &identity.User{Name: "user", Home: "/home/user"}
	cases := map[string]string{
		"":            "/home/user",
		"~":           "/home/user",
		"~/a/../b":    "/home/user/b",
		"rel/x":       "/home/user/rel/x",
		"/abs//y/":    "/abs/y",
		"../../etc/x": "/etc/x",
	}
	for in, want := range cases {
		if got, err := s.ResolvePath(in, u); err != nil || got != want {
			t.Errorf("%q -> %q, %v; want %q", in, got, err, want)
		}
	}
	if _, err := s.ResolvePath("~root/x", u); !errors.Is(err, ErrHomeExpansion) {
		t.Errorf("~root: %v", err)
	}
	s.SetDefaultWorkdir("/work")
	if got, _ := s.ResolvePath("", u); got != "/work" {
		t.Errorf("default workdir: %q", got)
	}
}

func TestBasicAuthUser(t *testing.T) {
	enc := func(s string) string { return "Basic " + base64.StdEncoding.EncodeToString([]byte(s)) }
	if n, ok := BasicAuthUser(enc("user:")); !ok || n != "user" {
		t.Fatal(n, ok)
	}
	if n, ok := BasicAuthUser(enc("root")); !ok || n != "root" {
		t.Fatal(n, ok)
	}
	if _, ok := BasicAuthUser("Bearer x"); ok {
		t.Fatal("bearer accepted")
	}
	if _, ok := BasicAuthUser("Basic !!!"); ok {
		t.Fatal("garbage accepted")
	}
}

func TestTokenAndDefaultUserFallback(t *testing.T) {
	root := t.TempDir()
	_ = os.MkdirAll(filepath.Join(root, "etc"), 0o755)
	_ = os.WriteFile(filepath.Join(root, "etc", "passwd"), []byte("root:x:0:0::/root:/bin/sh\n"), 0o644)
	s := New(identity.DB{Root: root}, "user")
	if u, err := s.ResolveUser(""); err != nil || u.Name != "root" {
		t.Fatalf("fallback to root: %+v %v", u, err)
	}
	if _, err := s.ResolveUser("user"); err == nil {
		t.Fatal("explicit unknown user accepted")
	}
	if s.TokenMatches("") {
		t.Fatal("empty token matches unset token")
	}
	s.SetAccessToken("t")
	if !s.TokenMatches("t") || s.TokenMatches("u") {
		t.Fatal("token match")
	}
}
