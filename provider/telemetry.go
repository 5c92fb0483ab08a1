package provider

import "github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"

// The pods' side of the node's telemetry (package telemetry): what it
// reads of the pods.

// RunningVMs counts the pods whose QEMU process the provider supervises.
func (p *VMs) RunningVMs() int {
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
	if t == nil || !t.waitingBoot(rec.uid) {
		return
	}
	pod := p.snapshot(rec)
	if a := t.takeBooting(rec.uid, func() bool { return podstatus.Ready(pod) }); a != nil {
		a.booted()
	}
}

// MemoryUse sums the running VMs' QEMU resident sets and working sets
// (telemetry.StateCollector).
func (p *VMs) MemoryUse() (rss, pss int64) {
	for _, ps := range p.samplePods() {
		rss += ps.rss
		pss += ps.workingSet()
	}
	return rss, pss
}
