package identity

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

func TestLookup(t *testing.T) {
	root := t.TempDir()
	_ = os.MkdirAll(filepath.Join(root, "etc"), 0o755)
	_ = os.WriteFile(filepath.Join(root, "etc", "passwd"), []byte(
		"# comment\nroot:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\nbroken:x:notanumber:1::/x:/bin/sh\n"), 0o644)
	_ = os.WriteFile(filepath.Join(root, "etc", "group"), []byte(
		"root:x:0:\nuser:x:1000:\nsudo:x:27:user,other\ndocker:x:999:other,user\n"), 0o644)
	db := DB{Root: root}

	u, err := db.Lookup("user")
	if err != nil {
		t.Fatal(err)
	}
	if u.UID != 1000 || u.GID != 1000 || u.Home != "/home/user" || len(u.Groups) != 2 || u.Groups[0] != 27 || u.Groups[1] != 999 {
		t.Fatalf("%+v", u)
	}
	if _, err := db.Lookup("ghost"); !errors.Is(err, ErrUnknownUser) {
		t.Fatalf("ghost: %v", err)
	}
	if _, err := db.Lookup("broken"); !errors.Is(err, ErrUnknownUser) {
		t.Fatalf("broken: %v", err)
	}
	if db.UserName(1000) != "user" || db.UserName(4242) != "4242" || db.GroupName(27) != "sudo" || db.GroupName(5) != "5" {
		t.Fatal("name lookups")
	}
	c := NewNameCache(db)
	if c.User(0) != "root" || c.Group(999) != "docker" || c.User(0) != "root" {
		t.Fatal("cache")
	}

	// No passwd file at all: root still resolves.
	empty := DB{Root: t.TempDir()}
	if u, err := empty.Lookup("root"); err != nil || u.UID != 0 || u.Home != "/root" {
		t.Fatalf("root fallback %+v %v", u, err)
	}
}
