package provider

import (
	"context"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/jstest"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
)

// rssBytes is this process's resident set size (VmRSS).
func rssBytes() int64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "VmRSS:") {
			f := strings.Fields(l)
			if len(f) >= 2 {
				kb, _ := strconv.ParseInt(f[1], 10, 64)
				return kb << 10
			}
		}
	}
	return 0
}

// cpuTime is the CPU time this process has used (user and system).
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// memPeak samples RSS and the Go heap in use every 20 ms until stop.
type memPeak struct {
	stop           chan struct{}
	done           chan struct{}
	mu             sync.Mutex
	rss, heapInUse int64
}

func sampleMem() *memPeak {
	m := &memPeak{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(m.done)
		t := time.NewTicker(20 * time.Millisecond)
		defer t.Stop()
		var ms runtime.MemStats
		for {
			r := rssBytes()
			runtime.ReadMemStats(&ms)
			m.mu.Lock()
			m.rss = max(m.rss, r)
			m.heapInUse = max(m.heapInUse, int64(ms.HeapInuse))
			m.mu.Unlock()
			select {
			case <-m.stop:
				return
			case <-t.C:
			}
		}
	}()
	return m
}

func (m *memPeak) end() (rss, heap int64) {
	close(m.stop)
	<-m.done
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.rss, m.heapInUse
}

// BenchmarkJumpstarterFlash: a 1 GiB raw image (incompressible, no zero
// blocks: the worst case for the flash, which skips zeros and hashes
// everything) flashed from a client file onto a powered-off VM's root
// partition through jstest's controller and router over TLS (client ->
// router -> exporter -> written aside, fsynced, checked, installed), as
// `j flasher flash` does; baselines on the same host and filesystem: `cat`
// of the same file to a file in the VM's state dir, and the same followed
// by `sync` of that file (the flash fsyncs). Reported: MB/s of each,
// x-of-cat and x-of-cat-sync (rate ratios, higher is better), and the
// process's peak RSS and Go heap in use during the flash above idle (the
// process holds the client and the router too, so the exporter's share
// is at most that), and the process's CPU time per GiB flashed (the
// client's, the router's and the agent's: CPU profiles label each party,
// `go tool pprof -tags`). One flash and one of each baseline per
// iteration; medians over iterations.
func BenchmarkJumpstarterFlash(b *testing.B) {
	testutil.SkipIfShort(b, "qemu-img checks the flashed image")
	const size = 1 << 30
	root := b.TempDir()
	stateDir := filepath.Join(root, "state")
	imageDir := filepath.Join(root, "images")
	require.NoError(b, os.MkdirAll(imageDir, 0o700))
	src := filepath.Join(root, "image.raw")
	f, err := os.Create(src)
	require.NoError(b, err)
	rng := rand.NewChaCha8([32]byte{1})
	buf := make([]byte, 1<<20)
	for n := 0; n < size; n += len(buf) {
		_, _ = rng.Read(buf)
		_, err := f.Write(buf)
		require.NoError(b, err)
	}
	require.NoError(b, f.Close())

	// Each party's goroutines carry a label in CPU profiles (pprof -tags).
	party := func(name string) {
		pprof.SetGoroutineLabels(pprof.WithLabels(context.Background(), pprof.Labels("party", name)))
	}
	defer pprof.SetGoroutineLabels(context.Background())
	party("router")
	ctrl, err := jstest.Start(jstest.Options{DialWait: 30 * time.Second})
	require.NoError(b, err)
	b.Cleanup(ctrl.Close)
	token := ctrl.AddExporter("lab", "board-0", "")
	secrets := &secretStore{m: map[string]*corev1.Secret{}}
	sec := podtest.ExporterSecret("endpoint", ctrl.Endpoint(), "token", token, "namespace", "lab", "name", "board-0", "ca.crt", string(ctrl.CABundle()))
	sec.Namespace, sec.Name = "default", "js"
	secrets.put(sec)
	party("agent")
	hv := newFakeHypervisor()
	h := newHarnessWith(b, stateDir, &fakeImages{dir: imageDir}, imageDir, func(c *VMsConfig) {
		c.Hypervisor = hv
		c.Secrets = secrets.get
		c.Exporters = realExporters
	})
	ctx := context.Background()
	pod := podFor("u-bench-flash", "reg.example/os:1", corev1.RestartPolicyAlways, map[string]string{v1alpha1.JumpstarterSecretAnnotation: "js"})
	require.NoError(b, h.vms.CreatePod(ctx, pod))
	<-hv.started
	h.wait(pod.UID, 10*time.Second, "Running", running)
	_, err = ctrl.WaitExporter(ctx, "lab", "board-0", func(s jstest.ExporterState) bool {
		return s.Online && s.Status == pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE
	})
	require.NoError(b, err)
	require.NoError(b, ctrl.AssignLease("lab", "bench", "board-0", "alice"))
	party("client")
	s, err := ctrl.NewClient("lab", "alice").Dial(ctx, "bench")
	require.NoError(b, err)
	defer s.Close()
	rep, err := s.GetReport(ctx)
	require.NoError(b, err)
	power, _ := jstest.FindDriver(rep, "power")
	flasher, _ := jstest.FindDriver(rep, "flasher")
	_, err = s.Call(ctx, power.GetUuid(), "off")
	require.NoError(b, err)
	catDst := filepath.Join(stateDir, VMsDirName, string(pod.UID), "cat-baseline")

	var ours, cats, catSyncs, cpus []time.Duration
	var peakRSS, peakHeap int64
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		out, err := exec.Command("sh", "-c", `cat "$1" > "$2"`, "sh", src, catDst).CombinedOutput()
		require.NoError(b, err, "%s", out)
		cats = append(cats, time.Since(t0))
		require.NoError(b, os.Remove(catDst))
		t0 = time.Now()
		out, err = exec.Command("sh", "-c", `cat "$1" > "$2" && sync "$2"`, "sh", src, catDst).CombinedOutput()
		require.NoError(b, err, "%s", out)
		catSyncs = append(catSyncs, time.Since(t0))
		require.NoError(b, os.Remove(catDst))

		runtime.GC()
		idleRSS := rssBytes()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		idleHeap := int64(ms.HeapInuse)
		mem := sampleMem()
		in, err := os.Open(src)
		require.NoError(b, err)
		t0, c0 := time.Now(), cpuTime()
		err = s.Flash(ctx, flasher.GetUuid(), in, "root", "")
		ours = append(ours, time.Since(t0))
		cpus = append(cpus, cpuTime()-c0)
		in.Close()
		rss, heap := mem.end()
		require.NoError(b, err)
		peakRSS = max(peakRSS, rss-idleRSS)
		peakHeap = max(peakHeap, heap-idleHeap)
	}
	b.StopTimer()
	mbps := func(d time.Duration) float64 { return float64(size) / 1e6 / d.Seconds() }
	mo, mc, ms := medianDur(ours), medianDur(cats), medianDur(catSyncs)
	b.ReportMetric(mbps(mo), "MB/s-flash")
	b.ReportMetric(mbps(mc), "MB/s-cat")
	b.ReportMetric(mbps(ms), "MB/s-cat-sync")
	b.ReportMetric(mc.Seconds()/mo.Seconds(), "x-of-cat")
	b.ReportMetric(ms.Seconds()/mo.Seconds(), "x-of-cat-sync")
	b.ReportMetric(medianDur(cpus).Seconds()*(1<<30)/size, "cpu-s/GiB")
	b.ReportMetric(float64(peakRSS)/(1<<20), "MiB-rss-over-idle")
	b.ReportMetric(float64(peakHeap)/(1<<20), "MiB-heap-over-idle")
}
