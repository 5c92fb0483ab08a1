package provider

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/qemu-kubelet/qemu-kubelet/provider/nodestatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/telemetry"
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
// figures. The node reports the host (/proc/stat, /proc/meminfo).
//
// UsageNanoCores (the instantaneous rate /stats/summary carries) needs two
// samples; the handler takes them StatsSampleWindow apart. /metrics/resource
// carries cumulative counters only (metrics-server computes rates).

// StatsSampleWindow is the interval between the two samples of a summary.
const StatsSampleWindow = 250 * time.Millisecond

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

// podSample is one pod's QEMU process reading.
type podSample struct {
	pod     *corev1.Pod
	started time.Time
	cpu     time.Duration
	rss     int64
	// pss is 0 when unknown.
	pss int64
	at  time.Time
}

// workingSet is PSS, or RSS when PSS is unknown.
func (ps podSample) workingSet() int64 {
	if ps.pss > 0 {
		return ps.pss
	}
	return ps.rss
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

// samplePods reads every running VM's QEMU process.
func (p *VMs) samplePods() []podSample {
	p.mu.Lock()
	recs := make([]*podVM, 0, len(p.pods))
	for _, r := range p.pods {
		recs = append(recs, r)
	}
	p.mu.Unlock()
	var out []podSample
	for _, r := range recs {
		r.mu.Lock()
		vm, pod := r.vm, r.pod
		var started time.Time
		if r.state.Running != nil {
			started = r.state.Running.StartedAt.Time
		}
		r.mu.Unlock()
		if vm == nil || started.IsZero() {
			continue
		}
		st, err := vm.Stats()
		if err != nil {
			continue // exited meanwhile
		}
		out = append(out, podSample{pod: pod, started: started, cpu: st.CPUTime, rss: st.RSSBytes, pss: st.PSSBytes, at: st.At})
	}
	sort.Slice(out, func(i, j int) bool {
		a, b := out[i].pod, out[j].pod
		if a.Namespace != b.Namespace {
			return a.Namespace < b.Namespace
		}
		return a.Name < b.Name
	})
	return out
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
func buildSummary(nodeName string, h0, h1 hostSample, p0, p1 []podSample) *statsv1alpha1.Summary {
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
	prev := map[string]podSample{}
	for _, ps := range p0 {
		prev[string(ps.pod.UID)] = ps
	}
	for _, ps := range p1 {
		cpu := &statsv1alpha1.CPUStats{Time: metav1.NewTime(ps.at), UsageCoreNanoSeconds: u64(int64(ps.cpu))}
		if old, ok := prev[string(ps.pod.UID)]; ok && old.started.Equal(ps.started) {
			cpu.UsageNanoCores = rateNanoCores(old.cpu, ps.cpu, old.at, ps.at)
		}
		mem := &statsv1alpha1.MemoryStats{Time: metav1.NewTime(ps.at), UsageBytes: u64(ps.rss), WorkingSetBytes: u64(ps.workingSet()), RSSBytes: u64(ps.rss)}
		name := "vm"
		if len(ps.pod.Spec.Containers) > 0 {
			name = ps.pod.Spec.Containers[0].Name
		}
		start := metav1.NewTime(ps.started)
		s.Pods = append(s.Pods, statsv1alpha1.PodStats{
			PodRef:     statsv1alpha1.PodReference{Name: ps.pod.Name, Namespace: ps.pod.Namespace, UID: string(ps.pod.UID)},
			StartTime:  start,
			Containers: []statsv1alpha1.ContainerStats{{Name: name, StartTime: start, CPU: cpu, Memory: mem}},
			CPU:        ptrCopy(cpu),
			Memory:     ptrCopy(mem),
		})
	}
	return s
}

// statsSummary serves GetStatsSummary: two samples StatsSampleWindow apart.
func (p *VMs) statsSummary(ctx context.Context) (*statsv1alpha1.Summary, error) {
	h0, p0 := readHost(), p.samplePods()
	t := time.NewTimer(StatsSampleWindow)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-t.C:
	}
	return buildSummary(p.cfg.NodeName, h0, readHost(), p0, p.samplePods()), nil
}

// metricsResource serves GetMetricsResource: the kubelet's
// /metrics/resource families metrics-server reads, from one sample.
func (p *VMs) metricsResource(context.Context) ([]*dto.MetricFamily, error) {
	return buildMetrics(readHost(), p.samplePods()), nil
}

func strp(s string) *string { return &s }

// buildMetrics is the /metrics/resource content (pure): node, pod and
// container CPU (cumulative seconds), working set memory and container
// start time, each sample with its timestamp, and resource_scrape_error;
// plus each VM's QEMU RSS and PSS (MetricVMMemoryRSS, MetricVMMemoryPSS),
// labelled by pod here, behind the kubelet API's authorization, rather than
// on the unauthenticated /metrics.
func buildMetrics(h hostSample, pods []podSample) []*dto.MetricFamily {
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
	vmRSS := fam(telemetry.MetricVMMemoryRSS, "Resident memory of the pod's QEMU process (guest RAM it touched and QEMU's own) in bytes", gauge)
	vmPSS := fam(telemetry.MetricVMMemoryPSS, "Proportional set size of the pod's QEMU process in bytes: pages shared with other processes (KSM-merged guest pages, libraries) counted in part", gauge)

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
		if len(ps.pod.Spec.Containers) > 0 {
			name = ps.pod.Spec.Containers[0].Name
		}
		cl := label("container", name, "namespace", ps.pod.Namespace, "pod", ps.pod.Name)
		pl := label("namespace", ps.pod.Namespace, "pod", ps.pod.Name)
		ctrCPU.Metric = append(ctrCPU.Metric, cnt(ps.cpu.Seconds(), ps.at, cl))
		ctrMem.Metric = append(ctrMem.Metric, gg(float64(ps.workingSet()), ps.at, cl))
		ctrStart.Metric = append(ctrStart.Metric, gg(float64(ps.started.UnixNano())/1e9, ps.at, cl))
		podCPU.Metric = append(podCPU.Metric, cnt(ps.cpu.Seconds(), ps.at, pl))
		podMem.Metric = append(podMem.Metric, gg(float64(ps.workingSet()), ps.at, pl))
		vmRSS.Metric = append(vmRSS.Metric, gg(float64(ps.rss), ps.at, pl))
		if ps.pss > 0 {
			vmPSS.Metric = append(vmPSS.Metric, gg(float64(ps.pss), ps.at, pl))
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
