package sudo

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"

	"forkyard/envd/internal/identity"
)

// Planned is what a sudo command line runs: Path with Argv (Argv[0] the name
// it sees), Env, in Dir ("" = the caller's), as Cred.
type Planned struct {
	Path string
	Argv []string
	Env  []string
	Dir  string
	Cred *syscall.Credential
}

// Usage is printed for a command line without a command.
const Usage = "usage: sudo [-u user] [-EHn] [-i | -s] [--] [VAR=value...] command [arg ...]\n" +
	"(this image has no sudo package: forkyard's built-in sudo understands these options)"

var envName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// kept is what a reset environment keeps of the caller's (as sudo's env_reset).
func kept(name string) bool {
	switch name {
	case "PATH", "TERM", "LANG", "LANGUAGE", "COLORTERM", "DISPLAY", "TZ", "COLUMNS", "LINES":
		return true
	}
	return strings.HasPrefix(name, "LC_")
}

// Plan parses a sudo command line (argv without "sudo") of the caller uid
// with environment env, for an image without the sudo package. It returns nil
// for a command line that runs nothing (-v, -k, -K).
//
// Supported: -u/--user USER (name or #uid), -E/--preserve-env, -H/--set-home,
// -n/--non-interactive, -S/--stdin (no password is asked anyway), -i/--login,
// -s/--shell, -k/-K/-v, --, VAR=value before the command. Anything else is an
// error naming the option.
func Plan(db identity.DB, args []string, env map[string]string, caller uint32) (*Planned, error) {
	target, preserve, setHome, login, shell, validate := "root", false, false, false, false, false
	i := 0
	takeValue := func(opt string, rest string) (string, error) {
		if rest != "" {
			return strings.TrimPrefix(rest, "="), nil
		}
		if i+1 >= len(args) {
			return "", fmt.Errorf("option requires an argument -- '%s'", opt)
		}
		i++
		return args[i], nil
	}
	for ; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			i++
			break
		}
		if !strings.HasPrefix(a, "-") || a == "-" {
			break
		}
		if strings.HasPrefix(a, "--") {
			name, value, hasValue := strings.Cut(a[2:], "=")
			rest := ""
			if hasValue {
				rest = "=" + value
			}
			switch name {
			case "user":
				v, err := takeValue("user", rest)
				if err != nil {
					return nil, err
				}
				target = v
			case "preserve-env":
				preserve = true
			case "set-home":
				setHome = true
			case "login":
				login = true
			case "shell":
				shell = true
			case "non-interactive", "stdin":
			case "validate", "reset-timestamp", "remove-timestamp":
				validate = true
			default:
				return nil, fmt.Errorf("option --%s is not supported here (this image has no sudo package)", name)
			}
			continue
		}
		for j := 1; j < len(a); j++ {
			switch c := a[j]; c {
			case 'u':
				v, err := takeValue("u", a[j+1:])
				if err != nil {
					return nil, err
				}
				target = v
				j = len(a)
			case 'E':
				preserve = true
			case 'H':
				setHome = true
			case 'i':
				login = true
			case 's':
				shell = true
			case 'n', 'S':
			case 'k', 'K', 'v':
				validate = true
			default:
				return nil, fmt.Errorf("option -%c is not supported here (this image has no sudo package)", c)
			}
		}
	}
	var assigns []string
	for ; i < len(args); i++ {
		k, _, ok := strings.Cut(args[i], "=")
		if !ok || !envName.MatchString(k) {
			break
		}
		assigns = append(assigns, args[i])
	}
	command := args[i:]
	if login && shell {
		return nil, fmt.Errorf("you may not specify both the -i and -s options")
	}
	if len(command) == 0 && !login && !shell {
		if validate {
			return nil, nil
		}
		return nil, fmt.Errorf("%s", Usage)
	}

	name := target
	if strings.HasPrefix(target, "#") {
		uid, err := strconv.ParseUint(target[1:], 10, 32)
		if err != nil {
			return nil, fmt.Errorf("unknown user %s", target)
		}
		name = db.UserName(uint32(uid))
	}
	u, err := db.Lookup(name)
	if err != nil {
		return nil, fmt.Errorf("unknown user %s", target)
	}
	callerName := db.UserName(caller)
	out := map[string]string{}
	for k, v := range env {
		if preserve || kept(k) {
			out[k] = v
		}
	}
	if !preserve || setHome || login {
		out["HOME"] = u.Home
	}
	if !preserve || login {
		out["USER"], out["LOGNAME"] = u.Name, u.Name
		out["SHELL"] = u.Shell
	}
	if _, ok := out["PATH"]; !ok {
		out["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	}
	out["SUDO_USER"] = callerName
	out["SUDO_UID"] = strconv.FormatUint(uint64(caller), 10)
	if cu, err := db.Lookup(callerName); err == nil {
		out["SUDO_GID"] = strconv.FormatUint(uint64(cu.GID), 10)
	}
	out["SUDO_COMMAND"] = strings.Join(command, " ")
	for _, kv := range assigns {
		k, v, _ := strings.Cut(kv, "=")
		out[k] = v
	}
	p := &Planned{
		Env:  envList(out),
		Cred: &syscall.Credential{Uid: u.UID, Gid: u.GID, Groups: append([]uint32{u.GID}, u.Groups...)},
	}
	if login || shell {
		sh := u.Shell
		if shell && env["SHELL"] != "" {
			sh = env["SHELL"]
		}
		if sh == "" || !isExecutable(sh) {
			sh = "/bin/sh"
		}
		argv0 := filepath.Base(sh)
		if login {
			argv0 = "-" + argv0
			p.Dir = u.Home
		}
		p.Path, p.Argv = sh, []string{argv0}
		if len(command) > 0 {
			p.Argv = append(p.Argv, "-c", shellJoin(command))
		}
		return p, nil
	}
	path, err := lookPath(command[0], out["PATH"])
	if err != nil {
		return nil, err
	}
	p.Path, p.Argv = path, command
	return p, nil
}

func isExecutable(p string) bool {
	st, err := os.Stat(p)
	return err == nil && !st.IsDir() && st.Mode()&0o111 != 0
}

func lookPath(name, path string) (string, error) {
	if strings.Contains(name, "/") {
		if isExecutable(name) {
			return name, nil
		}
		return "", fmt.Errorf("%s: command not found", name)
	}
	for _, dir := range filepath.SplitList(path) {
		if dir == "" {
			dir = "."
		}
		if p := filepath.Join(dir, name); isExecutable(p) {
			return p, nil
		}
	}
	return "", fmt.Errorf("%s: command not found", name)
}

// shellJoin quotes words for sh -c, as sudo -s/-i do with their command.
func shellJoin(words []string) string {
	out := make([]string, len(words))
	for i, w := range words {
		if w != "" && strings.Trim(w, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-./=:,+@%") == "" {
			out[i] = w
		} else {
			out[i] = "'" + strings.ReplaceAll(w, "'", `'\''`) + "'"
		}
	}
	return strings.Join(out, " ")
}
