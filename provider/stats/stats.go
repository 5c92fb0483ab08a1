// Package stats is the kubelet's resource stats of the node and its VM
// pods: the /stats/summary document (Summary) and the /metrics/resource
// families metrics-server reads (Resource), from host readings
// (/proc/stat, /proc/meminfo) and one sample of each VM's QEMU process
// (PodSample).
//
// stats knows the host readings of package nodestatus; it reads the pods
// through a sampling function (package provider samples its running VMs)
// and knows nothing of the pod worker.
package stats

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/qemu-kubelet/qemu-kubelet/provider/nodestatus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	statsv1alpha1 "k8s.io/kubelet/pkg/apis/stats/v1alpha1"
)

// Stats of a VM pod are those of its QEMU process (CPU time, resident
// memory): the VM's real cost on the node, guest RAM it touched included.
// Memory: rssBytes and usageBytes are QEMU's RSS; workingSetBytes is its
// PSS (proportional set size, /proc/<pid>/smaps_rollup), the VM's share of
// host memory when pages are shared with other VMs (KSM, page cache), RSS
// when PSS cannot be read. The pod and its one container report the same
// figures. A pod's ephemeral storage is what its state dir holds: the
// VM's disk (the overlay, and a flashed root or firmware, which replace
// or add to it), its console logs and records (DirUsage). The node
// reports the host (/proc/stat, /proc/meminfo).
//
// UsageNanoCores (the instantaneous rate /stats/summary carries) needs two
// samples; Summary takes them SampleWindow apart. /metrics/resource
// carries cumulative counters only (metrics-server computes rates).

// SampleWindow is the interval between the two samples of a summary.
const SampleWindow = 250 * time.Millisecond

// Host memory of each VM's QEMU process, per pod, on /metrics/resource
// (behind the kubelet API's authorization: pod names stay off the open
// /metrics, which has the sums, telemetry.MetricVMsMemoryRSS and
// telemetry.MetricVMsMemoryPSS).
const (
	MetricVMMemoryRSS = "qemu_kubelet_vm_memory_rss_bytes"
	MetricVMMemoryPSS = "qemu_kubelet_vm_memory_pss_bytes"
)

// hostCPU is one reading of /proc/stat's cpu line.
type hostCPU struct {
	// Busy is the CPU time spent not idle (all CPUs).
	Busy time.Duration
}

// parseProcStat reads the aggregate cpu line and btime of /proc/stat.
func parseProcStat(b []byte) (hostCPU, time.Time, error) {
	var cpu hostCPU
	var boot time.Time
	found := false
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 0 {
			continue
		}
		switch f[0] {
		case "cpu":
			if len(f) < 5 {
				return cpu, boot, fmt.Errorf("parse /proc/stat: short cpu line %q", sc.Text())
			}
			var busy int64
			for i, v := range f[1:] {
				n, err := strconv.ParseInt(v, 10, 64)
				if err != nil {
					return cpu, boot, fmt.Errorf("parse /proc/stat cpu field %d: %w", i+1, err)
				}
				// user nice system idle iowait irq softirq steal guest guest_nice:
				// idle and iowait are not busy; guest times are already in user.
				if i == 3 || i == 4 || i >= 8 {
					continue
				}
				busy += n
			}
			cpu.Busy = time.Duration(busy) * time.Second / 100
			found = true
		case "btime":
			if len(f) == 2 {
				if s, err := strconv.ParseInt(f[1], 10, 64); err == nil {
					boot = time.Unix(s, 0)
				}
			}
		}
	}
	if !found {
		return cpu, boot, fmt.Errorf("parse /proc/stat: no cpu line")
	}
	return cpu, boot, nil
}

// PodSample is one reading of a pod's QEMU process: the pod, when its
// current run started, its cumulative CPU time, its resident set and
// proportional set size (0 when unknown), and when it was read.
type PodSample struct {
	Pod     *corev1.Pod
	Started time.Time
	CPU     time.Duration
	RSS     int64
	PSS     int64
	At      time.Time
	// Disk is what the pod's state dir holds (nil: unknown).
	Disk *DirUsage
}

// DirUsage is a directory's use of its file system: the blocks its files
// hold (a sparse disk counts what it allocated, not its length) and its
// inodes, with the file system's free space and size.
type DirUsage struct {
	Used, Available, Capacity int64
	Inodes                    int64
	At                        time.Time
}

// ReadDirUsage sums the blocks and inodes under dir (entries that vanish
// meanwhile are skipped) and reads its file system's size and free space.
func ReadDirUsage(dir string) (*DirUsage, error) {
	var sfs syscall.Statfs_t
	if err := syscall.Statfs(dir, &sfs); err != nil {
		return nil, fmt.Errorf("disk usage of %s: %w", dir, err)
	}
	u := &DirUsage{At: time.Now(), Available: int64(sfs.Bavail) * int64(sfs.Bsize), Capacity: int64(sfs.Blocks) * int64(sfs.Bsize)}
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, os.ErrNotExist) && path != dir {
				return nil
			}
			return err
		}
		info, err := d.Info()
		if err != nil {
			return nil // gone meanwhile
		}
		if st, ok := info.Sys().(*syscall.Stat_t); ok {
			u.Used += st.Blocks * 512
		}
		u.Inodes++
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("disk usage of %s: %w", dir, err)
	}
	return u, nil
}

// WorkingSet is PSS, or RSS when PSS is unknown.
func (ps PodSample) WorkingSet() int64 {
	if ps.PSS > 0 {
		return ps.PSS
	}
	return ps.RSS
}

// hostSample is one node reading.
type hostSample struct {
	cpu      hostCPU
	boot     time.Time
	memTotal int64
	memAvail int64
	at       time.Time
	cpuErr   error
	memErr   error
}

func readHost() hostSample {
	h := hostSample{at: time.Now()}
	b, err := os.ReadFile("/proc/stat")
	if err == nil {
		h.cpu, h.boot, err = parseProcStat(b)
	}
	h.cpuErr = err
	b, err = os.ReadFile("/proc/meminfo")
	if err == nil {
		h.memTotal, h.memAvail, err = nodestatus.ParseMeminfo(b)
	}
	h.memErr = err
	return h
}

func u64(v int64) *uint64 {
	if v < 0 {
		v = 0
	}
	u := uint64(v)
	return &u
}

// rateNanoCores is the CPU rate between two cumulative readings.
func rateNanoCores(cpu0, cpu1 time.Duration, t0, t1 time.Time) *uint64 {
	dt := t1.Sub(t0)
	if dt <= 0 || cpu1 < cpu0 {
		return nil
	}
	return u64(int64(float64(cpu1-cpu0) / dt.Seconds()))
}

// buildSummary is the /stats/summary document from two samples (pure).
func buildSummary(nodeName string, h0, h1 hostSample, p0, p1 []PodSample) *statsv1alpha1.Summary {
	s := &statsv1alpha1.Summary{Node: statsv1alpha1.NodeStats{NodeName: nodeName}}
	if !h1.boot.IsZero() {
		s.Node.StartTime = metav1.NewTime(h1.boot)
	}
	if h1.cpuErr == nil {
		c := &statsv1alpha1.CPUStats{Time: metav1.NewTime(h1.at), UsageCoreNanoSeconds: u64(int64(h1.cpu.Busy))}
		if h0.cpuErr == nil {
			c.UsageNanoCores = rateNanoCores(h0.cpu.Busy, h1.cpu.Busy, h0.at, h1.at)
		}
		s.Node.CPU = c
	}
	if h1.memErr == nil {
		used := h1.memTotal - h1.memAvail
		s.Node.Memory = &statsv1alpha1.MemoryStats{Time: metav1.NewTime(h1.at), AvailableBytes: u64(h1.memAvail),
			UsageBytes: u64(used), WorkingSetBytes: u64(used)}
	}
	prev := map[string]PodSample{}
	for _, ps := range p0 {
		prev[string(ps.Pod.UID)] = ps
	}
	for _, ps := range p1 {
		cpu := &statsv1alpha1.CPUStats{Time: metav1.NewTime(ps.At), UsageCoreNanoSeconds: u64(int64(ps.CPU))}
		if old, ok := prev[string(ps.Pod.UID)]; ok && old.Started.Equal(ps.Started) {
			cpu.UsageNanoCores = rateNanoCores(old.CPU, ps.CPU, old.At, ps.At)
		}
		mem := &statsv1alpha1.MemoryStats{Time: metav1.NewTime(ps.At), UsageBytes: u64(ps.RSS), WorkingSetBytes: u64(ps.WorkingSet()), RSSBytes: u64(ps.RSS)}
		name := "vm"
		if len(ps.Pod.Spec.Containers) > 0 {
			name = ps.Pod.Spec.Containers[0].Name
		}
		start := metav1.NewTime(ps.Started)
		podStats := statsv1alpha1.PodStats{
			PodRef:     statsv1alpha1.PodReference{Name: ps.Pod.Name, Namespace: ps.Pod.Namespace, UID: string(ps.Pod.UID)},
			StartTime:  start,
			Containers: []statsv1alpha1.ContainerStats{{Name: name, StartTime: start, CPU: cpu, Memory: mem}},
			CPU:        ptrCopy(cpu),
			Memory:     ptrCopy(mem),
		}
		if d := ps.Disk; d != nil {
			podStats.EphemeralStorage = &statsv1alpha1.FsStats{Time: metav1.NewTime(d.At), UsedBytes: u64(d.Used),
				AvailableBytes: u64(d.Available), CapacityBytes: u64(d.Capacity), InodesUsed: u64(d.Inodes)}
		}
		s.Pods = append(s.Pods, podStats)
	}
	return s
}

// Summary is /stats/summary of node nodeName (the kubelet API's
// GetStatsSummary): two samples of the host and of pods, SampleWindow
// apart. pods samples the running VMs (sorted by namespace and name).
func Summary(ctx context.Context, nodeName string, pods func() []PodSample) (*statsv1alpha1.Summary, error) {
	h0, p0 := readHost(), pods()
	t := time.NewTimer(SampleWindow)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-t.C:
	}
	return buildSummary(nodeName, h0, readHost(), p0, pods()), nil
}

// Resource is /metrics/resource (the kubelet API's GetMetricsResource):
// the kubelet's families metrics-server reads, from one sample.
func Resource(pods func() []PodSample) []*dto.MetricFamily {
	return buildMetrics(readHost(), pods())
}

func strp(s string) *string { return &s }

// buildMetrics is the /metrics/resource content (pure): node, pod and
// container CPU (cumulative seconds), working set memory and container
// start time, each sample with its timestamp, and resource_scrape_error;
// plus each VM's QEMU RSS and PSS (MetricVMMemoryRSS, MetricVMMemoryPSS),
// labelled by pod here, behind the kubelet API's authorization, rather than
// on the unauthenticated /metrics.
func buildMetrics(h hostSample, pods []PodSample) []*dto.MetricFamily {
	counter, gauge := dto.MetricType_COUNTER, dto.MetricType_GAUGE
	fam := func(name, help string, typ dto.MetricType) *dto.MetricFamily {
		return &dto.MetricFamily{Name: strp(name), Help: strp(help), Type: &typ}
	}
	ms := func(t time.Time) *int64 { v := t.UnixMilli(); return &v }
	label := func(kv ...string) []*dto.LabelPair {
		var out []*dto.LabelPair
		for i := 0; i+1 < len(kv); i += 2 {
			out = append(out, &dto.LabelPair{Name: strp(kv[i]), Value: strp(kv[i+1])})
		}
		return out
	}
	cnt := func(v float64, t time.Time, l []*dto.LabelPair) *dto.Metric {
		return &dto.Metric{Label: l, Counter: &dto.Counter{Value: &v}, TimestampMs: ms(t)}
	}
	gg := func(v float64, t time.Time, l []*dto.LabelPair) *dto.Metric {
		return &dto.Metric{Label: l, Gauge: &dto.Gauge{Value: &v}, TimestampMs: ms(t)}
	}

	nodeCPU := fam("node_cpu_usage_seconds_total", "Cumulative cpu time consumed by the node in core-seconds", counter)
	nodeMem := fam("node_memory_working_set_bytes", "Current working set of the node in bytes", gauge)
	ctrCPU := fam("container_cpu_usage_seconds_total", "Cumulative cpu time consumed by the container in core-seconds", counter)
	ctrMem := fam("container_memory_working_set_bytes", "Current working set of the container in bytes", gauge)
	ctrStart := fam("container_start_time_seconds", "Start time of the container since unix epoch in seconds", gauge)
	podCPU := fam("pod_cpu_usage_seconds_total", "Cumulative cpu time consumed by the pod in core-seconds", counter)
	podMem := fam("pod_memory_working_set_bytes", "Current working set of the pod in bytes", gauge)
	scrapeErr := fam("resource_scrape_error", "1 if there was an error while getting container metrics, 0 otherwise", gauge)
	vmRSS := fam(MetricVMMemoryRSS, "Resident memory of the pod's QEMU process (guest RAM it touched and QEMU's own) in bytes", gauge)
	vmPSS := fam(MetricVMMemoryPSS, "Proportional set size of the pod's QEMU process in bytes: pages shared with other processes (KSM-merged guest pages, libraries) counted in part", gauge)

	failed := 0.0
	if h.cpuErr == nil {
		nodeCPU.Metric = append(nodeCPU.Metric, cnt(h.cpu.Busy.Seconds(), h.at, nil))
	} else {
		failed = 1
	}
	if h.memErr == nil {
		nodeMem.Metric = append(nodeMem.Metric, gg(float64(h.memTotal-h.memAvail), h.at, nil))
	} else {
		failed = 1
	}
	for _, ps := range pods {
		name := "vm"
		if len(ps.Pod.Spec.Containers) > 0 {
			name = ps.Pod.Spec.Containers[0].Name
		}
		cl := label("container", name, "namespace", ps.Pod.Namespace, "pod", ps.Pod.Name)
		pl := label("namespace", ps.Pod.Namespace, "pod", ps.Pod.Name)
		ctrCPU.Metric = append(ctrCPU.Metric, cnt(ps.CPU.Seconds(), ps.At, cl))
		ctrMem.Metric = append(ctrMem.Metric, gg(float64(ps.WorkingSet()), ps.At, cl))
		ctrStart.Metric = append(ctrStart.Metric, gg(float64(ps.Started.UnixNano())/1e9, ps.At, cl))
		podCPU.Metric = append(podCPU.Metric, cnt(ps.CPU.Seconds(), ps.At, pl))
		podMem.Metric = append(podMem.Metric, gg(float64(ps.WorkingSet()), ps.At, pl))
		vmRSS.Metric = append(vmRSS.Metric, gg(float64(ps.RSS), ps.At, pl))
		if ps.PSS > 0 {
			vmPSS.Metric = append(vmPSS.Metric, gg(float64(ps.PSS), ps.At, pl))
		}
	}
	scrapeErr.Metric = []*dto.Metric{{Gauge: &dto.Gauge{Value: &failed}}}
	out := []*dto.MetricFamily{ctrCPU, ctrMem, ctrStart, nodeCPU, nodeMem, podCPU, podMem, vmPSS, vmRSS, scrapeErr}
	// The text encoder rejects a family without samples.
	kept := out[:0]
	for _, f := range out {
		if len(f.Metric) > 0 {
			kept = append(kept, f)
		}
	}
	return kept
}

func ptrCopy[T any](v *T) *T {
	c := *v
	return &c
}
