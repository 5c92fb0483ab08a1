package provider

import (
	"context"
	"maps"
	"sort"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/telemetry"
	"github.com/virtual-kubelet/virtual-kubelet/errdefs"
	"github.com/virtual-kubelet/virtual-kubelet/node"
	"github.com/virtual-kubelet/virtual-kubelet/node/nodeutil"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
)

// CreatePod translates and admits the pod; an admitted pod gets its intent
// record on disk and a worker that pulls the image and runs the VM. A pod
// that is not admitted gets a Failed status naming why. Returns quickly: the
// work is asynchronous.
func (p *VMs) CreatePod(ctx context.Context, pod *corev1.Pod) error {
	called := time.Now()
	log := klog.FromContext(ctx).WithValues("pod", klog.KObj(pod), "uid", pod.UID)
	run := p.newRun(pod.DeepCopy())
	rec := run.rec
	rec.confirm.Do(func() { close(rec.confirmed) })
	rec.state.StartTime = p.now().UTC()
	plan, rej := podspec.Translate(pod, p.arch())
	node := p.nodeCapacity()

	// Admit and insert under one lock: the library calls CreatePod from
	// several workers, and two pods admitted against the same active set
	// could overcommit the node.
	p.mu.Lock()
	if _, known := p.pods[pod.UID]; known {
		p.mu.Unlock()
		return nil // already known (e.g. recovered): nothing to create
	}
	if rej == nil {
		rej = podspec.Admit(pod, plan, node, p.activePodsLocked())
	}
	if rej != nil {
		rec.state.Rejection = rej
		rec.state.Final = true
		close(rec.done)
	} else {
		rec.plan = plan
		rec.state.SetWaiting(podstatus.ReasonContainerCreating, "")
	}
	p.pods[pod.UID] = run
	p.mu.Unlock()
	if rej == nil {
		p.cfg.Telemetry.BeginTimeline(pod.UID, called) // telemetry/timeline.go
		p.cfg.Telemetry.Mark(pod.UID, telemetry.StepAdmitted, time.Now())
	}

	if rej != nil {
		log.Info("Pod not admitted", "reason", rej.Reason, "message", rej.Message)
		p.event(pod, corev1.EventTypeWarning, rej.Reason, rej.Message)
		p.push(rec)
		return nil
	}

	// The intent record is the worker's first step (worker.record): the
	// library's pod sync workers are not held by disk writes, so a burst's
	// pods reach their workers at once.
	rec.handoff.unrecorded = true
	log.Info("Pod admitted; creating VM", "image", plan.Image, "cpus", plan.CPUs, "memoryMiB", plan.MemoryMiB, "machine", plan.Machine)
	p.push(rec)
	go run.run()
	return nil
}

// UpdatePod refreshes the pod's metadata and spec as stored; a running VM
// is not changed. A pod with the same name but a new UID replaces the old
// one (whose VM is stopped).
func (p *VMs) UpdatePod(ctx context.Context, pod *corev1.Pod) error {
	p.mu.Lock()
	run := p.findLocked(pod.Namespace, pod.Name)
	p.mu.Unlock()
	if run == nil {
		return errdefs.NotFoundf("pod %s/%s not found on node %s", pod.Namespace, pod.Name, p.cfg.NodeName)
	}
	rec := run.rec
	if rec.uid != pod.UID {
		run.requestDelete(0)
		return p.CreatePod(ctx, pod)
	}
	rec.confirm.Do(func() { close(rec.confirmed) })
	cur := rec.podCopy()
	metaChanged := !maps.Equal(cur.Labels, pod.Labels) || !maps.Equal(cur.Annotations, pod.Annotations)
	next := pod.DeepCopy()
	next.Status = cur.Status
	rec.setPod(next)
	if metaChanged {
		// The library writes the last pod pushed, metadata included, and
		// the API server refuses a node's status update whose labels
		// differ: push the current metadata (e.g. a lease label set while
		// the agent was down, on a pod recovered from its state file).
		p.push(rec)
	}
	return nil
}

// DeletePod stops the VM gracefully (ACPI power button, then quit, then
// kill at the grace deadline), removes its state and pushes a terminal
// status. Asynchronous and idempotent; an unknown pod is NotFound.
func (p *VMs) DeletePod(ctx context.Context, pod *corev1.Pod) error {
	p.mu.Lock()
	run := p.pods[pod.UID]
	if run == nil {
		run = p.findLocked(pod.Namespace, pod.Name)
	}
	p.mu.Unlock()
	if run == nil {
		return errdefs.NotFoundf("pod %s/%s not found on node %s", pod.Namespace, pod.Name, p.cfg.NodeName)
	}
	rec := run.rec
	grace := podstatus.DeleteGrace(pod, p.cfg.DefaultGrace)
	// rec.pod is replaced, never changed in place: readers that took it
	// keep a stable pod.
	rec.updatePod(func(cur *corev1.Pod) {
		if pod.DeletionTimestamp != nil {
			cur.DeletionTimestamp = pod.DeletionTimestamp.DeepCopy()
			cur.DeletionGracePeriodSeconds = pod.DeletionGracePeriodSeconds
		}
		if pod.UID == rec.uid {
			// The library calls UpdatePod only for pods not being deleted: a
			// label changed just before the deletion (a lease released)
			// arrives here. The terminal status carries the metadata, and
			// the API server refuses a node's status update whose labels
			// differ.
			cur.Labels = maps.Clone(pod.Labels)
			cur.Annotations = maps.Clone(pod.Annotations)
		}
	})
	klog.FromContext(ctx).Info("Deleting pod", "pod", klog.KObj(pod), "uid", rec.uid, "grace", grace)
	run.requestDelete(grace)
	return nil
}

// requestDelete has the pod deleted with grace: its worker stops the VM
// and forgets the pod (finishDelete; at once for a rejected pod, which has
// no worker). Idempotent.
func (r *podRun) requestDelete(grace time.Duration) {
	rec := r.rec
	first := rec.beginDelete(grace)
	if first {
		close(rec.deleteReq)
	}
	rec.confirm.Do(func() { close(rec.confirmed) })
	if first && rec.stateCopy().Rejection != nil {
		// Never had a VM: done at once.
		go r.finishDelete()
	}
}

// GetPod returns the pod as the provider knows it, or NotFound. It also
// tells a recovered pod that the API server still has it.
func (p *VMs) GetPod(_ context.Context, namespace, name string) (*corev1.Pod, error) {
	p.mu.Lock()
	run := p.findLocked(namespace, name)
	p.mu.Unlock()
	if run != nil {
		if run.rec.deletion().deleting {
			// A pod being stopped is gone for the library: a new pod of the
			// same name (StatefulSet) must be created, not "updated".
			run = nil
		}
	}
	if run == nil {
		return nil, errdefs.NotFoundf("pod %s/%s not found on node %s", namespace, name, p.cfg.NodeName)
	}
	rec := run.rec
	rec.confirm.Do(func() { close(rec.confirmed) })
	return p.withStatus(rec), nil
}

// GetPodStatus returns the pod's status or NotFound.
func (p *VMs) GetPodStatus(ctx context.Context, namespace, name string) (*corev1.PodStatus, error) {
	pod, err := p.GetPod(ctx, namespace, name)
	if err != nil {
		return nil, err
	}
	return &pod.Status, nil
}

// GetPods returns exactly the pods this node has (running, stopping or
// finished), with their namespace, name and UID as bound.
func (p *VMs) GetPods(context.Context) ([]*corev1.Pod, error) {
	recs := p.records()
	out := make([]*corev1.Pod, 0, len(recs))
	for _, r := range recs {
		out = append(out, p.withStatus(r))
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Namespace != out[j].Namespace {
			return out[i].Namespace < out[j].Namespace
		}
		return out[i].Name < out[j].Name
	})
	return out, nil
}

// NotifyPods registers the library's status callback and pushes every
// current status (pods recovered before the callback existed).
func (p *VMs) NotifyPods(_ context.Context, cb func(*corev1.Pod)) {
	p.setNotify(cb)
	for _, r := range p.records() {
		p.push(r)
	}
}

var (
	_ nodeutil.Provider = (*VMs)(nil)
	_ node.PodNotifier  = (*VMs)(nil)
)
