package identity

import (
	"runtime"
	"syscall"
	"unsafe"
)

// AsUser runs fn with exactly u's file permissions, as if u did it (E2B envd
// semantics for the files API: user "user" cannot read /etc/shadow or write
// into root's 0700 home; root can). For root, fn runs as is. Otherwise fn runs
// on a goroutine locked to its own OS thread whose credentials (supplementary
// groups, real/effective/saved gid and uid) are set to u's by raw syscalls,
// which change only that thread; the goroutine never unlocks, so the Go
// runtime ends the thread when fn returns and no other goroutine ever runs
// with u's credentials. Returns fn's error, or the errno of a failed switch.
//
// Files fn opens stay usable after it returns (permissions are checked at
// open), so callers open inside fn and read or write outside.
func AsUser(u *User, fn func() error) error {
	if u == nil || u.UID == 0 {
		return fn()
	}
	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread exits with this goroutine
		if err := setThreadCreds(u); err != nil {
			done <- err
			return
		}
		done <- fn()
	}()
	return <-done
}

func setThreadCreds(u *User) error {
	groups := make([]uint32, 0, len(u.Groups)+1)
	groups = append(groups, u.GID)
	groups = append(groups, u.Groups...)
	if _, _, e := syscall.RawSyscall(syscall.SYS_SETGROUPS, uintptr(len(groups)), uintptr(unsafe.Pointer(&groups[0])), 0); e != 0 {
		return e
	}
	if _, _, e := syscall.RawSyscall(syscall.SYS_SETRESGID, uintptr(u.GID), uintptr(u.GID), uintptr(u.GID)); e != 0 {
		return e
	}
	if _, _, e := syscall.RawSyscall(syscall.SYS_SETRESUID, uintptr(u.UID), uintptr(u.UID), uintptr(u.UID)); e != 0 {
		return e
	}
	return nil
}
