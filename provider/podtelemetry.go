package provider

// The pods' side of the node's telemetry (package telemetry): what it
// reads of the pods.

// RunningVMs counts the pods whose QEMU process the provider supervises
// (none when p is nil: the collector is built before the pods exist).
func (p *VMs) RunningVMs() int {
	if p == nil {
		return 0
	}
	recs := p.records()
	n := 0
	for _, r := range recs {
		if r.vm.get() != nil {
			n++
		}
	}
	return n
}

// endBoot ends the boot span of rec's current start, if one waits for
// Ready: the worker's action on the run's first Ready (podworker.go).
func (r *podRun) endBoot() {
	p, rec := r.node, r.rec
	t := p.cfg.Telemetry
	if t == nil {
		return
	}
	if a := t.TakeBooting(rec.uid); a != nil {
		a.Booted()
	}
}

// MemoryUse sums the running VMs' QEMU resident sets and working sets
// (telemetry.StateCollector).
func (p *VMs) MemoryUse() (rss, pss int64) {
	if p == nil {
		return 0, 0
	}
	for _, ps := range p.samplePods() {
		rss += ps.RSS
		pss += ps.WorkingSet()
	}
	return rss, pss
}
