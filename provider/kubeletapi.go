package provider

import (
	"context"
	"fmt"
	"io"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/qemu-kubelet/qemu-kubelet/provider/guest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/stats"
	"github.com/virtual-kubelet/virtual-kubelet/errdefs"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
	corev1 "k8s.io/api/core/v1"
	statsv1alpha1 "k8s.io/kubelet/pkg/apis/stats/v1alpha1"
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
	run := p.findLocked(namespace, name)
	p.mu.Unlock()
	if run == nil {
		return podView{}, errdefs.NotFoundf("pod %s/%s not found on node %s", namespace, name, p.cfg.NodeName)
	}
	rec := run.rec
	pod, st := rec.read()
	v := podView{pod: pod, dir: rec.dir, vm: rec.vm.get(), everStarted: st.Started}
	if len(pod.Spec.Containers) > 0 {
		v.container = pod.Spec.Containers[0].Name
	}
	if st.Waiting != nil {
		v.waiting = st.Waiting.Reason
	}
	switch {
	case st.Running != nil:
		v.started = st.Running.StartedAt.Time
	case st.Terminated != nil:
		v.started = st.Terminated.StartedAt.Time
	}
	if container != "" && container != v.container {
		return podView{}, errdefs.InvalidInputf("container %s is not valid for pod %s (a VM pod has one container, %q)", container, name, v.container)
	}
	return v, nil
}

// consoleLogs serves GetContainerLogs.
func (p *VMs) consoleLogs(ctx context.Context, namespace, name, container string, opts api.ContainerLogOpts) (io.ReadCloser, error) {
	v, err := p.view(namespace, name, container)
	if err != nil {
		return nil, err
	}
	if v.vm == nil && !v.everStarted && !opts.Previous {
		// Never ran: as the kubelet says it.
		reason := v.waiting
		if reason == "" {
			reason = podstatus.ReasonContainerCreating
		}
		return nil, errdefs.InvalidInputf("container %q in pod %q is waiting to start: %s", v.container, name, reason)
	}
	src := guest.ConsoleLogSource{Dir: v.dir, Pod: namespace + "/" + name, Now: p.now}
	if v.vm != nil {
		src.Done = v.vm.Done()
	}
	return guest.ConsoleLogs(ctx, src, opts)
}

// attachToConsole serves AttachToContainer.
func (p *VMs) attachToConsole(ctx context.Context, namespace, name, container string, attach api.AttachIO) error {
	v, err := p.view(namespace, name, container)
	if err != nil {
		return err
	}
	if v.vm == nil {
		return errdefs.InvalidInputf("attach to pod %s/%s: its VM is not running", namespace, name)
	}
	if err := guest.AttachConsole(ctx, v.vm, v.dir, attach); err != nil {
		return fmt.Errorf("attach to the console of pod %s/%s: %w", namespace, name, err)
	}
	return nil
}

// portForward serves PortForward.
func (p *VMs) portForward(ctx context.Context, namespace, name string, port int32, stream io.ReadWriteCloser) error {
	v, err := p.view(namespace, name, "")
	if err != nil {
		stream.Close()
		return err
	}
	if v.vm == nil {
		stream.Close()
		return errdefs.InvalidInputf("port-forward to pod %s/%s: its VM is not running", namespace, name)
	}
	if err := guest.ForwardGuestPort(ctx, v.vm, port, stream); err != nil {
		return fmt.Errorf("port-forward to port %d of pod %s/%s: %w", port, namespace, name, err)
	}
	return nil
}

// execInVM serves RunInContainer (see above).
func (p *VMs) execInVM(ctx context.Context, namespace, name, container string, cmd []string, attach api.AttachIO) error {
	v, err := p.view(namespace, name, container)
	if err != nil {
		return err
	}
	if v.vm == nil {
		return errdefs.InvalidInputf("exec in pod %s/%s: its VM is not running", namespace, name)
	}
	return guest.Exec(ctx, v.vm, namespace, name, cmd, attach)
}

// GetContainerLogs returns the VM's serial console (guest/logs.go).
func (p *VMs) GetContainerLogs(ctx context.Context, namespace, podName, containerName string, opts api.ContainerLogOpts) (io.ReadCloser, error) {
	return p.consoleLogs(ctx, namespace, podName, containerName, opts)
}

// RunInContainer: exec needs a guest agent (guest/exec.go).
func (p *VMs) RunInContainer(ctx context.Context, namespace, podName, containerName string, cmd []string, attach api.AttachIO) error {
	return p.execInVM(ctx, namespace, podName, containerName, cmd, attach)
}

// AttachToContainer attaches to the VM's serial console (guest/attach.go).
func (p *VMs) AttachToContainer(ctx context.Context, namespace, podName, containerName string, attach api.AttachIO) error {
	return p.attachToConsole(ctx, namespace, podName, containerName, attach)
}

// PortForward forwards to a guest TCP port (guest/portforward.go).
func (p *VMs) PortForward(ctx context.Context, namespace, pod string, port int32, stream io.ReadWriteCloser) error {
	return p.portForward(ctx, namespace, pod, port, stream)
}

// GetStatsSummary reports the node and each VM's QEMU process (package
// stats).
func (p *VMs) GetStatsSummary(ctx context.Context) (*statsv1alpha1.Summary, error) {
	return stats.Summary(ctx, p.cfg.NodeName, p.samplePods)
}

// GetMetricsResource is /metrics/resource for metrics-server (package
// stats).
func (p *VMs) GetMetricsResource(context.Context) ([]*dto.MetricFamily, error) {
	return stats.Resource(p.samplePods), nil
}
