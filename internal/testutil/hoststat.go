package testutil

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// The host readings the density benchmarks share (qemu's BenchmarkIdleDensity,
// provider's BenchmarkIdlePodDensity): MemAvailable, CPU busy time, the
// pacing of VM starts on MemAvailable, and where a QEMU's memory goes.

// EnvInt is the positive integer in environment variable name, def when
// it is unset or not a positive integer.
func EnvInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

// MemAvailable is the host's MemAvailable (/proc/meminfo) in bytes.
func MemAvailable() (int64, error) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) >= 2 && f[0] == "MemAvailable:" {
			v, err := strconv.ParseInt(f[1], 10, 64)
			return v << 10, err
		}
	}
	return 0, fmt.Errorf("no MemAvailable in /proc/meminfo")
}

// MemSample is the host's MemAvailable once it is over the floor, or
// when the wait for it ended, and how long that wait was.
type MemSample struct {
	Bytes  int64
	Waited time.Duration
}

// AwaitMemory paces VM starts as a node under memory pressure does (its
// MemoryPressure condition taints it and the scheduler places nothing
// until the condition clears): while MemAvailable is under floor it polls
// every 2 s, at most max in all, for boots to settle (and KSM, where it
// runs, to merge the new guests' pages).
func AwaitMemory(ctx context.Context, floor int64, max time.Duration) (MemSample, error) {
	start := time.Now()
	for {
		v, err := MemAvailable()
		if err != nil || v >= floor || time.Since(start) >= max || ctx.Err() != nil {
			return MemSample{Bytes: v, Waited: time.Since(start)}, err
		}
		time.Sleep(2 * time.Second)
	}
}

// CPUTimes are the host's busy and total CPU ticks (all CPUs).
type CPUTimes struct{ Busy, Total int64 }

// BusyPercentSince is the share of the host's CPU time busy between
// before and t (all CPUs; 0 when no time passed).
func (t CPUTimes) BusyPercentSince(before CPUTimes) float64 {
	if dt := t.Total - before.Total; dt > 0 {
		return float64(t.Busy-before.Busy) / float64(dt) * 100
	}
	return 0
}

// HostCPUTimes reads the aggregate cpu line of /proc/stat (ticks); idle
// and iowait are not busy, guest times are already in user.
func HostCPUTimes() (CPUTimes, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return CPUTimes{}, err
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 5 || f[0] != "cpu" {
		return CPUTimes{}, fmt.Errorf("/proc/stat: unexpected first line %q", line)
	}
	var t CPUTimes
	for i, v := range f[1:] {
		if i >= 8 {
			break
		}
		x, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return CPUTimes{}, fmt.Errorf("/proc/stat: %w", err)
		}
		t.Total += x
		if i != 3 && i != 4 {
			t.Busy += x
		}
	}
	return t, nil
}
