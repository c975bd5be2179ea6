package httpapi

import (
	"bufio"
	"io"
	"math"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Metrics is the body of GET /metrics (E2B envd's field names).
//
// Under gVisor the sandbox's /proc/stat is all zeros, so CPUUsedPct is 0
// there; the forkyard host replaces it with a figure from the sandbox's
// cgroup (forkyard/orchestrator). Memory figures come from the sandbox's own
// /proc/meminfo (gVisor accounts its memory there); disk figures from
// statfs("/") (the rootfs overlay).
type Metrics struct {
	Timestamp   int64   `json:"ts"`
	CPUCount    int     `json:"cpu_count"`
	CPUUsedPct  float64 `json:"cpu_used_pct"`
	MemTotal    uint64  `json:"mem_total"`
	MemUsed     uint64  `json:"mem_used"`
	MemCache    uint64  `json:"mem_cache"`
	MemTotalMiB uint64  `json:"mem_total_mib"`
	MemUsedMiB  uint64  `json:"mem_used_mib"`
	DiskUsed    uint64  `json:"disk_used"`
	DiskTotal   uint64  `json:"disk_total"`
}

// metricsSampler computes CPU usage as the busy share of /proc/stat time
// since the previous sample.
type metricsSampler struct {
	mu              sync.Mutex
	statPath        string
	lastBusy, lastT uint64
}

func newMetricsSampler() *metricsSampler {
	m := &metricsSampler{statPath: "/proc/stat"}
	m.lastBusy, m.lastT, _ = m.read()
	return m
}

func (m *metricsSampler) read() (busy, total uint64, ok bool) {
	f, err := os.Open(m.statPath)
	if err != nil {
		return 0, 0, false
	}
	defer f.Close()
	return parseCPU(f)
}

// parseCPU returns busy and total jiffies from the aggregate "cpu" line of
// /proc/stat (proc(5)): total = user..steal, idle = idle + iowait.
func parseCPU(r io.Reader) (busy, total uint64, ok bool) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 || fields[0] != "cpu" {
			continue
		}
		var vals []uint64
		for _, s := range fields[1:] {
			v, _ := strconv.ParseUint(s, 10, 64)
			vals = append(vals, v)
		}
		for i, v := range vals {
			if i >= 8 { // guest, guest_nice are already in user/nice
				break
			}
			total += v
		}
		idle := vals[3]
		if len(vals) > 4 {
			idle += vals[4] // iowait
		}
		return total - idle, total, true
	}
	return 0, 0, false
}

// cpuPct is the busy share (0-100, all CPUs together, like gopsutil's
// cpu.Percent that E2B's envd uses) since the previous call.
func (m *metricsSampler) cpuPct() float64 {
	busy, total, ok := m.read()
	if !ok {
		return 0
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	db, dt := busy-m.lastBusy, total-m.lastT
	if total < m.lastT || busy < m.lastBusy || dt == 0 {
		m.lastBusy, m.lastT = busy, total
		return 0
	}
	m.lastBusy, m.lastT = busy, total
	return math.Round(float64(db)/float64(dt)*10000) / 100
}

// memInfo holds /proc/meminfo figures in bytes.
type memInfo struct{ total, used, cache uint64 }

// parseMeminfo reads /proc/meminfo text (proc(5), kB units): used = MemTotal -
// MemAvailable (MemFree + Buffers + Cached without it), cache = Cached.
func parseMeminfo(r io.Reader) memInfo {
	vals := map[string]uint64{}
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		k, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		fields := strings.Fields(rest)
		if len(fields) == 0 {
			continue
		}
		v, _ := strconv.ParseUint(fields[0], 10, 64)
		vals[k] = v * 1024
	}
	total := vals["MemTotal"]
	avail, ok := vals["MemAvailable"]
	if !ok {
		avail = vals["MemFree"] + vals["Buffers"] + vals["Cached"]
	}
	if avail > total {
		avail = total
	}
	return memInfo{total: total, used: total - avail, cache: vals["Cached"]}
}

func readMem() memInfo {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return memInfo{}
	}
	defer f.Close()
	return parseMeminfo(f)
}

// diskUsage is statfs(path): used = (blocks - free) * bsize, total = blocks * bsize.
func diskUsage(path string) (used, total uint64) {
	var sfs unix.Statfs_t
	if err := unix.Statfs(path, &sfs); err != nil {
		return 0, 0
	}
	bs := uint64(sfs.Bsize)
	return (sfs.Blocks - sfs.Bfree) * bs, sfs.Blocks * bs
}

func (a *API) getMetrics(w http.ResponseWriter, _ *http.Request) {
	mem := readMem()
	m := Metrics{
		Timestamp:   time.Now().UTC().Unix(),
		CPUCount:    runtime.NumCPU(),
		CPUUsedPct:  a.metrics.cpuPct(),
		MemTotal:    mem.total,
		MemUsed:     mem.used,
		MemCache:    mem.cache,
		MemTotalMiB: mem.total >> 20,
		MemUsedMiB:  mem.used >> 20,
	}
	m.DiskUsed, m.DiskTotal = diskUsage("/")
	writeJSON(w, http.StatusOK, m)
}

// setClock sets the system clock to t when it is off by more than a second
// (fails quietly without CAP_SYS_TIME, e.g. under gVisor).
func setClock(t time.Time, logf func(string, ...any)) {
	if d := time.Since(t); d < time.Second && d > -time.Second {
		return
	}
	tv := syscall.NsecToTimeval(t.UnixNano())
	if err := syscall.Settimeofday(&tv); err != nil {
		logf("envd: not setting clock: %v", err)
	}
}
