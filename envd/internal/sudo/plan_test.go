package sudo

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"forkyard/envd/internal/identity"
)

func testDB(t *testing.T) identity.DB {
	root := t.TempDir()
	must := func(err error) {
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(root, "etc"), 0o755))
	must(os.WriteFile(filepath.Join(root, "etc/passwd"), []byte("root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n"), 0o644))
	must(os.WriteFile(filepath.Join(root, "etc/group"), []byte("root:x:0:\nuser:x:1000:\nsudo:x:27:user\n"), 0o644))
	return identity.DB{Root: root}
}

func envOf(p *Planned) map[string]string { return envMap(p.Env) }

func TestPlanDefaultsToRootWithResetEnv(t *testing.T) {
	db := testDB(t)
	p, err := Plan(db, []string{"sh", "-c", "id -u"}, map[string]string{"PATH": "/usr/bin:/bin", "SECRET": "x", "HOME": "/home/user"}, 1000)
	if err != nil {
		t.Fatal(err)
	}
	if p.Cred.Uid != 0 || p.Argv[0] != "sh" || !strings.HasSuffix(p.Path, "/sh") {
		t.Fatalf("%+v", p)
	}
	e := envOf(p)
	if e["HOME"] != "/root" || e["USER"] != "root" || e["SUDO_USER"] != "user" || e["SUDO_UID"] != "1000" || e["SECRET"] != "" {
		t.Fatalf("env %v", e)
	}
}

func TestPlanOptions(t *testing.T) {
	db := testDB(t)
	env := map[string]string{"PATH": "/usr/bin:/bin", "KEEP": "1"}
	p, err := Plan(db, []string{"-E", "-u", "user", "--", "A=b", "true"}, env, 0)
	if err != nil {
		t.Fatal(err)
	}
	if p.Cred.Uid != 1000 || envOf(p)["KEEP"] != "1" || envOf(p)["A"] != "b" {
		t.Fatalf("%+v", p)
	}
	p, err = Plan(db, []string{"-iu", "user", "echo", "a b"}, env, 0)
	if err != nil {
		t.Fatal(err)
	}
	if p.Argv[0] != "-sh" || p.Argv[2] != "echo 'a b'" || p.Dir != "/home/user" {
		t.Fatalf("%+v", p)
	}
	if p, err := Plan(db, []string{"-v"}, env, 1000); p != nil || err != nil {
		t.Fatalf("-v: %v %v", p, err)
	}
	for _, bad := range [][]string{{"-b", "true"}, {"--chroot=/", "true"}, {}, {"-u"}, {"-u", "nobody", "true"}, {"no-such-command-x"}} {
		if _, err := Plan(db, bad, env, 1000); err == nil {
			t.Fatalf("%v: no error", bad)
		}
	}
}
