package httpapi

import (
	"bufio"
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

// Metrics is the body of GET /metrics (E2B's field names).
type Metrics struct {
	Timestamp   int64   `json:"ts"`
	CPUCount    int     `json:"cpu_count"`
	CPUUsedPct  float64 `json:"cpu_used_pct"`
	MemTotal    uint64  `json:"mem_total"`
	MemUsed     uint64  `json:"mem_used"`
	MemTotalMiB uint64  `json:"mem_total_mib"`
	MemUsedMiB  uint64  `json:"mem_used_mib"`
	DiskUsed    uint64  `json:"disk_used"`
	DiskTotal   uint64  `json:"disk_total"`
}

// metricsSampler computes CPU usage as the busy share of /proc/stat time
// since the previous sample.
type metricsSampler struct {
	mu              sync.Mutex
	lastBusy, lastT uint64
}

func newMetricsSampler() *metricsSampler {
	m := &metricsSampler{}
	m.lastBusy, m.lastT, _ = readCPU()
	return m
}

// readCPU returns busy and total jiffies from the aggregate "cpu" line.
func readCPU() (busy, total uint64, ok bool) {
	f, err := os.Open("/proc/stat")
	if err != nil {
		return 0, 0, false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
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

func (m *metricsSampler) cpuPct() float64 {
	busy, total, ok := readCPU()
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

func readMem() (total, used uint64) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, 0
	}
	defer f.Close()
	vals := map[string]uint64{}
	sc := bufio.NewScanner(f)
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
	total = vals["MemTotal"]
	avail, ok := vals["MemAvailable"]
	if !ok {
		avail = vals["MemFree"] + vals["Buffers"] + vals["Cached"]
	}
	if avail > total {
		avail = total
	}
	return total, total - avail
}

func (a *API) getMetrics(w http.ResponseWriter, _ *http.Request) {
	memTotal, memUsed := readMem()
	m := Metrics{
		Timestamp:   time.Now().UTC().Unix(),
		CPUCount:    runtime.NumCPU(),
		CPUUsedPct:  a.metrics.cpuPct(),
		MemTotal:    memTotal,
		MemUsed:     memUsed,
		MemTotalMiB: memTotal >> 20,
		MemUsedMiB:  memUsed >> 20,
	}
	var sfs unix.Statfs_t
	if err := unix.Statfs("/", &sfs); err == nil {
		bs := uint64(sfs.Bsize)
		m.DiskTotal = sfs.Blocks * bs
		m.DiskUsed = (sfs.Blocks - sfs.Bfree) * bs
	}
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
