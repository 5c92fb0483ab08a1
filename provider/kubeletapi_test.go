package provider

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/virtual-kubelet/virtual-kubelet/errdefs"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

func TestParseProcStat(t *testing.T) {
	b := []byte("cpu  100 5 50 1000 20 3 2 1 40 0\ncpu0 1 2 3 4 5 6 7 8 9 10\nintr 1\nbtime 1700000000\n")
	c, boot, err := parseProcStat(b)
	require.NoError(t, err)
	// user+nice+system+irq+softirq+steal = 100+5+50+3+2+1 = 161 ticks.
	assert.Equal(t, 1610*time.Millisecond, c.Busy)
	assert.Equal(t, int64(1700000000), boot.Unix())
	_, _, err = parseProcStat([]byte("intr 1\n"))
	assert.Error(t, err)
	_, _, err = parseProcStat([]byte("cpu 1 x 3 4\n"))
	assert.Error(t, err)
}

func statsPod(ns, name, uid string) *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID("u-" + uid)},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "vm"}}}}
}

func TestBuildSummaryAndMetrics(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	t1 := t0.Add(500 * time.Millisecond)
	started := t0.Add(-time.Minute)
	pod := statsPod("default", "vm1", "1")
	h0 := hostSample{cpu: hostCPU{Busy: 10 * time.Second}, at: t0, memTotal: 8 << 30, memAvail: 6 << 30}
	h1 := hostSample{cpu: hostCPU{Busy: 11 * time.Second}, at: t1, memTotal: 8 << 30, memAvail: 5 << 30, boot: t0.Add(-time.Hour)}
	p0 := []podSample{{pod: pod, started: started, cpu: 2 * time.Second, rss: 100 << 20, at: t0}}
	p1 := []podSample{{pod: pod, started: started, cpu: 2250 * time.Millisecond, rss: 120 << 20, pss: 110 << 20, at: t1}}

	s := buildSummary("n1", h0, h1, p0, p1)
	assert.Equal(t, "n1", s.Node.NodeName)
	require.NotNil(t, s.Node.CPU.UsageNanoCores)
	assert.Equal(t, uint64(2e9), *s.Node.CPU.UsageNanoCores, "1s of CPU in 0.5s = 2 cores")
	assert.Equal(t, uint64(3<<30), *s.Node.Memory.WorkingSetBytes)
	require.Len(t, s.Pods, 1)
	ps := s.Pods[0]
	assert.Equal(t, "vm1", ps.PodRef.Name)
	assert.Equal(t, "u-1", ps.PodRef.UID)
	assert.Equal(t, uint64(5e8), *ps.CPU.UsageNanoCores, "0.25s in 0.5s = half a core")
	assert.Equal(t, uint64(2250*time.Millisecond), *ps.CPU.UsageCoreNanoSeconds)
	assert.Equal(t, uint64(110<<20), *ps.Memory.WorkingSetBytes, "working set is QEMU's PSS")
	assert.Equal(t, uint64(120<<20), *ps.Memory.RSSBytes)
	assert.Equal(t, uint64(120<<20), *ps.Memory.UsageBytes)
	require.Len(t, ps.Containers, 1)
	assert.Equal(t, "vm", ps.Containers[0].Name)
	assert.Equal(t, *ps.CPU.UsageNanoCores, *ps.Containers[0].CPU.UsageNanoCores)

	// A pod restarted between the samples has no rate.
	p1r := []podSample{{pod: pod, started: t1, cpu: time.Second, rss: 1, at: t1}}
	assert.Nil(t, buildSummary("n1", h0, h1, p0, p1r).Pods[0].CPU.UsageNanoCores)

	// /metrics/resource: the text metrics-server parses.
	var buf bytes.Buffer
	enc := expfmt.NewEncoder(&buf, expfmt.NewFormat(expfmt.TypeTextPlain))
	for _, mf := range buildMetrics(h1, p1) {
		require.NoError(t, enc.Encode(mf))
	}
	text := buf.String()
	for _, want := range []string{
		`container_cpu_usage_seconds_total{container="vm",namespace="default",pod="vm1"} 2.25 ` + msStr(t1),
		`container_memory_working_set_bytes{container="vm",namespace="default",pod="vm1"} 1.1534336e+08 ` + msStr(t1),
		`qemu_kubelet_vm_memory_rss_bytes{namespace="default",pod="vm1"} 1.2582912e+08 ` + msStr(t1),
		`qemu_kubelet_vm_memory_pss_bytes{namespace="default",pod="vm1"} 1.1534336e+08 ` + msStr(t1),
		`pod_cpu_usage_seconds_total{namespace="default",pod="vm1"} 2.25 ` + msStr(t1),
		`node_cpu_usage_seconds_total 11 ` + msStr(t1),
		`node_memory_working_set_bytes 3.221225472e+09 ` + msStr(t1),
		"resource_scrape_error 0",
		"# TYPE container_cpu_usage_seconds_total counter",
	} {
		assert.Contains(t, text, want)
	}
	// No pods: families without samples are left out (the encoder rejects them).
	buf.Reset()
	for _, mf := range buildMetrics(hostSample{at: t1, cpuErr: errors.New("x"), memErr: errors.New("y")}, nil) {
		require.NoError(t, enc.Encode(mf))
	}
	assert.Equal(t, "# HELP resource_scrape_error 1 if there was an error while getting container metrics, 0 otherwise\n# TYPE resource_scrape_error gauge\nresource_scrape_error 1\n", buf.String())
}

func msStr(t time.Time) string { return strconv.FormatInt(t.UnixMilli(), 10) }

// tcpPair is a connected loopback TCP pair, closed when the test ends.
func tcpPair(t *testing.T) (net.Conn, net.Conn) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	acc := make(chan net.Conn, 1)
	go func() {
		c, _ := l.Accept()
		acc <- c
	}()
	a, err := net.Dial("tcp", l.Addr().String())
	require.NoError(t, err)
	b := <-acc
	require.NotNil(t, b)
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

// TestViewAndLogErrors: the lookups behind logs/attach/exec/port-forward
// on a pod record (no VM).
func TestViewAndLogErrors(t *testing.T) {
	ctx := context.Background()
	p := NewVMs(ctx, VMsConfig{NodeName: "n1"})
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "web", UID: "u1"},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "vm"}}}}
	rec := &podVM{uid: pod.UID, dir: t.TempDir(), pod: pod, deleteReq: make(chan struct{})}
	rec.state.SetWaiting(podstatus.ReasonErrImagePull, "nope")
	p.pods[pod.UID] = rec

	_, err := p.GetContainerLogs(ctx, "ns", "web", "vm", api.ContainerLogOpts{})
	require.Error(t, err)
	assert.True(t, errdefs.IsInvalidInput(err))
	assert.Equal(t, `container "vm" in pod "web" is waiting to start: ErrImagePull`, err.Error())

	_, err = p.GetContainerLogs(ctx, "ns", "web", "other", api.ContainerLogOpts{})
	assert.True(t, errdefs.IsInvalidInput(err))
	assert.Contains(t, err.Error(), "container other is not valid for pod web")
	_, err = p.GetContainerLogs(ctx, "ns", "nope", "vm", api.ContainerLogOpts{})
	assert.True(t, errdefs.IsNotFound(err))

	err = p.AttachToContainer(ctx, "ns", "web", "vm", nil)
	assert.True(t, errdefs.IsInvalidInput(err))
	assert.Contains(t, err.Error(), "its VM is not running")
	err = p.RunInContainer(ctx, "ns", "web", "vm", []string{"ls"}, nil)
	assert.True(t, errdefs.IsInvalidInput(err))
	assert.Contains(t, err.Error(), "exec in pod ns/web: its VM is not running")
	s1, s2 := tcpPair(t)
	_ = s2
	err = p.PortForward(ctx, "ns", "web", 80, s1)
	assert.True(t, errdefs.IsInvalidInput(err))

	// A VM ran once (now in back-off): logs show what it wrote.
	rec.state.Started = true
	rec.state.SetWaiting(podstatus.ReasonCrashLoopBackOff, "")
	writeConsole(t, rec.dir, qemu.ConsoleLogName, "last run\n", time.Now())
	rc, err := p.GetContainerLogs(ctx, "ns", "web", "", api.ContainerLogOpts{})
	require.NoError(t, err)
	b, _ := io.ReadAll(rc)
	rc.Close()
	assert.Equal(t, "last run\n", string(b))
}

func writeConsole(t *testing.T, dir, name, content string, mtime time.Time) {
	t.Helper()
	p := filepath.Join(dir, name)
	require.NoError(t, os.WriteFile(p, []byte(content), 0o600))
	require.NoError(t, os.Chtimes(p, mtime, mtime))
}
