package httpapi

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

const meminfo = `MemTotal:         524288 kB
MemFree:          283788 kB
MemAvailable:     300000 kB
Buffers:               0 kB
Cached:            16244 kB
`

func TestParseMeminfo(t *testing.T) {
	m := parseMeminfo(strings.NewReader(meminfo))
	if m.total != 524288*1024 || m.used != (524288-300000)*1024 || m.cache != 16244*1024 {
		t.Fatalf("got %+v", m)
	}
	// Without MemAvailable (older kernels): free + buffers + cached.
	m = parseMeminfo(strings.NewReader("MemTotal: 1000 kB\nMemFree: 100 kB\nBuffers: 10 kB\nCached: 40 kB\n"))
	if m.total != 1000*1024 || m.used != 850*1024 || m.cache != 40*1024 {
		t.Fatalf("got %+v", m)
	}
}

func TestParseCPU(t *testing.T) {
	// user nice system idle iowait irq softirq steal guest guest_nice
	busy, total, ok := parseCPU(strings.NewReader("cpu  10 2 8 70 5 1 3 1 99 99\ncpu0 1 1 1 1\n"))
	if !ok || total != 100 || busy != 25 {
		t.Fatalf("busy %d total %d ok %v", busy, total, ok)
	}
	if _, _, ok := parseCPU(strings.NewReader("intr 1 2 3\n")); ok {
		t.Fatal("no cpu line must not be ok")
	}
}

// cpuPct is the busy share between two reads of the stat file.
func TestCPUPctIsBusyShareSincePreviousSample(t *testing.T) {
	path := filepath.Join(t.TempDir(), "stat")
	write := func(user, idle int) {
		t.Helper()
		line := "cpu  " + itoa(user) + " 0 0 " + itoa(idle) + " 0 0 0 0 0 0\n"
		if err := os.WriteFile(path, []byte(line), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(100, 300)
	m := &metricsSampler{statPath: path}
	m.lastBusy, m.lastT, _ = m.read()
	write(175, 325) // +75 busy, +25 idle
	if got := m.cpuPct(); got != 75 {
		t.Fatalf("cpuPct %v, want 75", got)
	}
	write(185, 415) // +10 busy, +90 idle
	if got := m.cpuPct(); got != 10 {
		t.Fatalf("cpuPct %v, want 10", got)
	}
	write(185, 415) // no time passed
	if got := m.cpuPct(); got != 0 {
		t.Fatalf("cpuPct %v, want 0", got)
	}
}

func TestDiskUsageIsStatfs(t *testing.T) {
	used, total := diskUsage(t.TempDir())
	if total == 0 || used == 0 || used > total {
		t.Fatalf("used %d total %d", used, total)
	}
	if u, tot := diskUsage("/nonexistent/path"); u != 0 || tot != 0 {
		t.Fatalf("missing path gave %d %d", u, tot)
	}
}

func itoa(v int) string { return strconv.Itoa(v) }
