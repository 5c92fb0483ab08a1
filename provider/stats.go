package provider

import (
	"sort"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/stats"
)

// samplePods reads every running VM's QEMU process (package stats builds
// the kubelet's resource stats from them; MemoryUse sums them), sorted by
// namespace and name.
func (p *VMs) samplePods() []stats.PodSample {
	recs := p.records()
	var out []stats.PodSample
	for _, r := range recs {
		vm, dir := r.vm.get(), r.dir
		pod, state := r.read()
		var started time.Time
		if state.Running != nil {
			started = state.Running.StartedAt.Time
		}
		if vm == nil || started.IsZero() {
			continue
		}
		st, err := vm.Stats()
		if err != nil {
			continue // exited meanwhile
		}
		ps := stats.PodSample{Pod: pod, Started: started, CPU: st.CPUTime, RSS: st.RSSBytes, PSS: st.PSSBytes, At: st.At}
		if du, err := stats.ReadDirUsage(dir); err == nil {
			ps.Disk = du
		}
		out = append(out, ps)
	}
	sort.Slice(out, func(i, j int) bool {
		a, b := out[i].Pod, out[j].Pod
		if a.Namespace != b.Namespace {
			return a.Namespace < b.Namespace
		}
		return a.Name < b.Name
	})
	return out
}
