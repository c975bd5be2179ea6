package fsutil

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

func TestReplaceMetadataClearsOldKeys(t *testing.T) {
	path := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(path, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := WriteMetadata(path, map[string]string{"a": "1", "b": "2"}); err != nil {
		if errors.Is(err, unix.ENOTSUP) {
			t.Skip("no user xattrs on this filesystem")
		}
		t.Fatal(err)
	}
	if err := ReplaceMetadata(path, map[string]string{"b": "3"}); err != nil {
		t.Fatal(err)
	}
	if md := ReadMetadata(path); len(md) != 1 || md["b"] != "3" {
		t.Fatalf("after replace: %v", md)
	}
	if err := ReplaceMetadata(path, nil); err != nil {
		t.Fatal(err)
	}
	if md := ReadMetadata(path); len(md) != 0 {
		t.Fatalf("after clearing: %v", md)
	}
}
