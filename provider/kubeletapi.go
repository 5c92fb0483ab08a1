package provider

import (
	"time"

	"github.com/virtual-kubelet/virtual-kubelet/errdefs"
	corev1 "k8s.io/api/core/v1"
)

// podView is what the kubelet API handlers (logs, attach, port-forward,
// exec, stats) need of one pod: a consistent snapshot taken under the pod's
// lock, so the handlers never hold it while streaming.
type podView struct {
	pod *corev1.Pod
	// dir is the pod's state dir (console logs live there).
	dir string
	// vm is the running VM, nil when none runs (waiting, exited).
	vm VM
	// started is when the current (or last) run started; zero if none.
	started time.Time
	// container is the name of the pod's one container.
	container string
	// waiting is the container's waiting reason ("" when not waiting).
	waiting string
	// everStarted: a VM was started for the pod at least once.
	everStarted bool
}

// view finds namespace/name and checks container (empty: the pod's one
// container). Unknown pod: NotFound; wrong container: InvalidInput, with the
// kubelet's wording.
func (p *VMs) view(namespace, name, container string) (podView, error) {
	p.mu.Lock()
	rec := p.findLocked(namespace, name)
	p.mu.Unlock()
	if rec == nil {
		return podView{}, errdefs.NotFoundf("pod %s/%s not found on node %s", namespace, name, p.cfg.NodeName)
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	v := podView{pod: rec.pod.DeepCopy(), dir: rec.dir, vm: rec.vm, everStarted: rec.state.Started}
	if len(rec.pod.Spec.Containers) > 0 {
		v.container = rec.pod.Spec.Containers[0].Name
	}
	if rec.state.Waiting != nil {
		v.waiting = rec.state.Waiting.Reason
	}
	switch {
	case rec.state.Running != nil:
		v.started = rec.state.Running.StartedAt.Time
	case rec.state.Terminated != nil:
		v.started = rec.state.Terminated.StartedAt.Time
	}
	if container != "" && container != v.container {
		return podView{}, errdefs.InvalidInputf("container %s is not valid for pod %s (a VM pod has one container, %q)", container, name, v.container)
	}
	return v, nil
}
