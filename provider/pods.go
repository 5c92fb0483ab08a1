package provider

import (
	"context"
	"fmt"
	"io"
	"sort"
	"sync"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/virtual-kubelet/virtual-kubelet/errdefs"
	"github.com/virtual-kubelet/virtual-kubelet/node"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
	"github.com/virtual-kubelet/virtual-kubelet/node/nodeutil"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	statsv1alpha1 "k8s.io/kubelet/pkg/apis/stats/v1alpha1"
)

// ReasonVMsNotSupported is the pod status reason given to every pod bound to
// a node whose qemu-kubelet does not run VMs yet.
const ReasonVMsNotSupported = "VMsNotSupported"

// UnsupportedPods is the pod side of the provider until VMs land: like a
// kubelet rejecting a pod at admission, it records each pod bound to the node
// and pushes phase Failed with reason VMsNotSupported and a message, so that
// owners see a clear terminal status instead of a pod stuck Pending. It keeps
// exactly the pods it was given (GetPods), and DeletePod pushes a terminal
// status and forgets the pod.
type UnsupportedPods struct {
	nodeName string
	version  string
	now      func() time.Time

	mu     sync.Mutex
	pods   map[types.NamespacedName]*corev1.Pod
	notify func(*corev1.Pod)
}

// NewUnsupportedPods returns the pod handler for node nodeName; version goes
// into the status message.
func NewUnsupportedPods(nodeName, version string) *UnsupportedPods {
	return &UnsupportedPods{nodeName: nodeName, version: version, now: time.Now, pods: map[types.NamespacedName]*corev1.Pod{}}
}

func key(ns, name string) types.NamespacedName {
	return types.NamespacedName{Namespace: ns, Name: name}
}

// Message is the status message of a rejected pod.
func (p *UnsupportedPods) Message() string {
	return fmt.Sprintf("qemu-kubelet %s on node %s does not run VMs yet: pods bound to this node are not started", p.version, p.nodeName)
}

// rejectedStatus is the terminal status of a pod: Failed, every container
// terminated with the same reason.
func (p *UnsupportedPods) rejectedStatus(pod *corev1.Pod, now metav1.Time) corev1.PodStatus {
	msg := p.Message()
	st := corev1.PodStatus{
		Phase:     corev1.PodFailed,
		Reason:    ReasonVMsNotSupported,
		Message:   msg,
		StartTime: &now,
		Conditions: []corev1.PodCondition{
			{Type: corev1.PodScheduled, Status: corev1.ConditionTrue, LastTransitionTime: now},
			{Type: corev1.PodInitialized, Status: corev1.ConditionFalse, Reason: ReasonVMsNotSupported, Message: msg, LastTransitionTime: now},
			{Type: corev1.ContainersReady, Status: corev1.ConditionFalse, Reason: ReasonVMsNotSupported, Message: msg, LastTransitionTime: now},
			{Type: corev1.PodReady, Status: corev1.ConditionFalse, Reason: ReasonVMsNotSupported, Message: msg, LastTransitionTime: now},
		},
	}
	if pod.Status.StartTime != nil {
		st.StartTime = pod.Status.StartTime
	}
	term := func(cs []corev1.Container) []corev1.ContainerStatus {
		var out []corev1.ContainerStatus
		for _, c := range cs {
			out = append(out, corev1.ContainerStatus{
				Name:  c.Name,
				Image: c.Image,
				State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{
					ExitCode: 128, Reason: ReasonVMsNotSupported, Message: msg, FinishedAt: now,
				}},
			})
		}
		return out
	}
	st.InitContainerStatuses = term(pod.Spec.InitContainers)
	st.ContainerStatuses = term(pod.Spec.Containers)
	return st
}

// CreatePod records the pod and pushes its Failed status.
func (p *UnsupportedPods) CreatePod(ctx context.Context, pod *corev1.Pod) error {
	rec := pod.DeepCopy()
	rec.Status = p.rejectedStatus(pod, metav1.NewTime(p.now()))
	p.mu.Lock()
	p.pods[key(pod.Namespace, pod.Name)] = rec
	notify := p.notify
	p.mu.Unlock()
	klog.FromContext(ctx).Info("Rejecting pod: VMs are not supported yet", "pod", klog.KObj(pod), "uid", pod.UID)
	if notify != nil {
		notify(rec.DeepCopy())
	}
	return nil
}

// UpdatePod keeps the recorded status; only the spec/metadata are refreshed.
func (p *UnsupportedPods) UpdatePod(_ context.Context, pod *corev1.Pod) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	k := key(pod.Namespace, pod.Name)
	old, ok := p.pods[k]
	if !ok {
		return errdefs.NotFoundf("pod %s not found on node %s", k, p.nodeName)
	}
	rec := pod.DeepCopy()
	rec.Status = old.Status
	p.pods[k] = rec
	return nil
}

// DeletePod pushes a terminal status and forgets the pod. Deleting an
// unknown pod is NotFound, as the library expects.
func (p *UnsupportedPods) DeletePod(ctx context.Context, pod *corev1.Pod) error {
	k := key(pod.Namespace, pod.Name)
	p.mu.Lock()
	rec, ok := p.pods[k]
	delete(p.pods, k)
	notify := p.notify
	p.mu.Unlock()
	if !ok {
		return errdefs.NotFoundf("pod %s not found on node %s", k, p.nodeName)
	}
	final := pod.DeepCopy()
	final.Status = rec.Status
	klog.FromContext(ctx).Info("Forgetting deleted pod", "pod", klog.KObj(pod))
	if notify != nil {
		notify(final)
	}
	return nil
}

// GetPod returns the recorded pod or NotFound.
func (p *UnsupportedPods) GetPod(_ context.Context, namespace, name string) (*corev1.Pod, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	rec, ok := p.pods[key(namespace, name)]
	if !ok {
		return nil, errdefs.NotFoundf("pod %s/%s not found on node %s", namespace, name, p.nodeName)
	}
	return rec.DeepCopy(), nil
}

// GetPodStatus returns the recorded pod's status or NotFound.
func (p *UnsupportedPods) GetPodStatus(ctx context.Context, namespace, name string) (*corev1.PodStatus, error) {
	pod, err := p.GetPod(ctx, namespace, name)
	if err != nil {
		return nil, err
	}
	return &pod.Status, nil
}

// GetPods returns exactly the recorded pods, sorted by namespace/name.
func (p *UnsupportedPods) GetPods(context.Context) ([]*corev1.Pod, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]*corev1.Pod, 0, len(p.pods))
	for _, rec := range p.pods {
		out = append(out, rec.DeepCopy())
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Namespace != out[j].Namespace {
			return out[i].Namespace < out[j].Namespace
		}
		return out[i].Name < out[j].Name
	})
	return out, nil
}

// NotifyPods registers the library's status callback.
func (p *UnsupportedPods) NotifyPods(_ context.Context, cb func(*corev1.Pod)) {
	p.mu.Lock()
	p.notify = cb
	p.mu.Unlock()
}

func (p *UnsupportedPods) notRunning(namespace, name string) error {
	return errdefs.NotFoundf("pod %s/%s has no running VM: %s", namespace, name, p.Message())
}

// GetContainerLogs: no VM, no console.
func (p *UnsupportedPods) GetContainerLogs(_ context.Context, namespace, podName, _ string, _ api.ContainerLogOpts) (io.ReadCloser, error) {
	return nil, p.notRunning(namespace, podName)
}

// RunInContainer: no VM to run in.
func (p *UnsupportedPods) RunInContainer(_ context.Context, namespace, podName, _ string, _ []string, _ api.AttachIO) error {
	return p.notRunning(namespace, podName)
}

// AttachToContainer: no VM to attach to.
func (p *UnsupportedPods) AttachToContainer(_ context.Context, namespace, podName, _ string, _ api.AttachIO) error {
	return p.notRunning(namespace, podName)
}

// PortForward: no VM to forward to.
func (p *UnsupportedPods) PortForward(_ context.Context, namespace, pod string, _ int32, _ io.ReadWriteCloser) error {
	return p.notRunning(namespace, pod)
}

// GetStatsSummary reports the node with no pods.
func (p *UnsupportedPods) GetStatsSummary(context.Context) (*statsv1alpha1.Summary, error) {
	return &statsv1alpha1.Summary{Node: statsv1alpha1.NodeStats{NodeName: p.nodeName}}, nil
}

// GetMetricsResource reports no metrics yet.
func (p *UnsupportedPods) GetMetricsResource(context.Context) ([]*dto.MetricFamily, error) {
	return nil, nil
}

var (
	_ nodeutil.Provider = (*UnsupportedPods)(nil)
	_ node.PodNotifier  = (*UnsupportedPods)(nil)
	_ node.NodeProvider = (*NodeStatus)(nil)
)
