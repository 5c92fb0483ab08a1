package stats

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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
	p0 := []PodSample{{Pod: pod, Started: started, CPU: 2 * time.Second, RSS: 100 << 20, At: t0}}
	p1 := []PodSample{{Pod: pod, Started: started, CPU: 2250 * time.Millisecond, RSS: 120 << 20, PSS: 110 << 20, At: t1}}

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
	p1r := []PodSample{{Pod: pod, Started: t1, CPU: time.Second, RSS: 1, At: t1}}
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

func TestEphemeralStorage(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(dir, "flash"), 0o700))
	f, err := os.Create(filepath.Join(dir, "flash", "root"))
	require.NoError(t, err)
	require.NoError(t, f.Truncate(64<<20)) // 64 MiB long, 1 MiB allocated
	_, err = f.WriteAt(bytes.Repeat([]byte{1}, 1<<20), 32<<20)
	require.NoError(t, err)
	require.NoError(t, f.Close())
	require.NoError(t, os.WriteFile(filepath.Join(dir, "status.json"), []byte("{}"), 0o600))

	u, err := ReadDirUsage(dir)
	require.NoError(t, err)
	assert.GreaterOrEqual(t, u.Used, int64(1<<20))
	assert.Less(t, u.Used, int64(2<<20), "a sparse file counts the blocks it holds, not its length")
	assert.Equal(t, int64(4), u.Inodes, "the dir, flash/, flash/root, status.json")
	assert.Positive(t, u.Capacity)
	assert.LessOrEqual(t, u.Available, u.Capacity)
	_, err = ReadDirUsage(filepath.Join(dir, "missing"))
	assert.Error(t, err)

	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	pod := statsPod("default", "vm1", "1")
	h := hostSample{at: t0}
	with := []PodSample{{Pod: pod, Started: t0, At: t0, Disk: &DirUsage{Used: 3 << 20, Available: 10 << 30, Capacity: 20 << 30, Inodes: 5, At: t0}}}
	es := buildSummary("n1", h, h, nil, with).Pods[0].EphemeralStorage
	require.NotNil(t, es)
	assert.Equal(t, uint64(3<<20), *es.UsedBytes)
	assert.Equal(t, uint64(10<<30), *es.AvailableBytes)
	assert.Equal(t, uint64(20<<30), *es.CapacityBytes)
	assert.Equal(t, uint64(5), *es.InodesUsed)
	without := []PodSample{{Pod: pod, Started: t0, At: t0}}
	assert.Nil(t, buildSummary("n1", h, h, nil, without).Pods[0].EphemeralStorage, "unknown usage is left out")
}
