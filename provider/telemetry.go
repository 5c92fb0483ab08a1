package provider

import "github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"

// The pods' side of the node's telemetry (package telemetry): what it
// reads of the pods.

// RunningVMs counts the pods whose QEMU process the provider supervises
// (none when p is nil: the collector is built before the pods exist).
func (p *VMs) RunningVMs() int {
	if p == nil {
		return 0
	}
	p.mu.Lock()
	recs := make([]*podVM, 0, len(p.pods))
	for _, r := range p.pods {
		recs = append(recs, r)
	}
	p.mu.Unlock()
	n := 0
	for _, r := range recs {
		r.mu.Lock()
		if r.vm != nil {
			n++
		}
		r.mu.Unlock()
	}
	return n
}

// observeReady ends the boot span of rec once its pod reports Ready
// (called on every status push; cheap unless a start waits for Ready).
func (p *VMs) observeReady(rec *podVM) {
	t := p.cfg.Telemetry
	if t == nil || !t.WaitingBoot(rec.uid) {
		return
	}
	pod := p.snapshot(rec)
	if a := t.TakeBooting(rec.uid, func() bool { return podstatus.Ready(pod) }); a != nil {
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
		rss += ps.rss
		pss += ps.workingSet()
	}
	return rss, pss
}
