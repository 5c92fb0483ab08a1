package nodestatus

import (
	"context"
	"maps"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
)

// NodeStatus is the virtual-kubelet NodeProvider of qemu-kubelet: it samples
// the host every StatusUpdateFrequency and pushes the node status (and
// labels/annotations) through NotifyNodeStatus when something other than
// timestamps changed. The library re-posts the last status periodically and
// renews the node lease.
type NodeStatus struct {
	facts Facts
	read  func() (HostReadings, error)
	now   func() time.Time

	mu     sync.Mutex
	cb     func(*corev1.Node)
	last   *corev1.Node
	images func() []corev1.ContainerImage
}

// SetImages sets the source of node.status.images (the image cache), used
// from the next sample on.
func (s *NodeStatus) SetImages(f func() []corev1.ContainerImage) {
	s.mu.Lock()
	s.images = f
	if f != nil {
		s.last.Status.Images = f()
	}
	s.mu.Unlock()
}

// SetConfigState records the outcome of a configuration (re)load and
// pushes the node's ConfigOK condition and features annotation at once.
func (s *NodeStatus) SetConfigState(ctx context.Context, cs ConfigState) {
	s.mu.Lock()
	s.facts.ConfigState = cs
	s.mu.Unlock()
	s.Refresh(ctx)
}

// Allocatable is the node's allocatable from the last sample (admission).
func (s *NodeStatus) Allocatable() corev1.ResourceList {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.last.Status.Allocatable.DeepCopy()
}

// NewNodeStatus builds the NodeProvider from the fixed facts and a host
// reader, and takes the first sample for the registration node.
func NewNodeStatus(ctx context.Context, facts Facts, read func() (HostReadings, error)) *NodeStatus {
	s := &NodeStatus{facts: facts, read: read, now: time.Now}
	h := s.sample(ctx)
	s.last = RegistrationNode(facts, h, metav1.NewTime(s.now()))
	return s
}

// RegistrationNode returns a copy of the node to register.
func (s *NodeStatus) RegistrationNode() *corev1.Node {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.last.DeepCopy()
}

func (s *NodeStatus) sample(ctx context.Context) HostReadings {
	h, err := s.read()
	if err != nil {
		klog.FromContext(ctx).Error(err, "Incomplete host readings")
	}
	return h
}

// Ping reports the provider alive; host problems are reported through
// conditions instead, so that status keeps flowing.
func (s *NodeStatus) Ping(ctx context.Context) error { return ctx.Err() }

// NotifyNodeStatus registers the library's callback.
func (s *NodeStatus) NotifyNodeStatus(_ context.Context, cb func(*corev1.Node)) {
	s.mu.Lock()
	s.cb = cb
	s.mu.Unlock()
}

// Run samples the host every StatusUpdateFrequency until ctx ends.
func (s *NodeStatus) Run(ctx context.Context) {
	t := time.NewTicker(s.facts.Config.StatusUpdateFrequency)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			s.Refresh(ctx)
		}
	}
}

// Refresh takes one sample and notifies the library when the status changed.
// It reports whether a notification was sent.
func (s *NodeStatus) Refresh(ctx context.Context) bool {
	h := s.sample(ctx)
	s.mu.Lock()
	if s.cb == nil {
		// Not registered with the node controller yet: keep the last pushed
		// state so that this change is not lost.
		s.mu.Unlock()
		return false
	}
	next := s.last.DeepCopy()
	next.Status = Status(s.last.Status.Conditions, s.facts, h, metav1.NewTime(s.now()))
	if s.images != nil {
		next.Status.Images = s.images()
	}
	maps.Copy(next.Labels, Labels(s.facts))
	maps.Copy(next.Annotations, Annotations(s.facts))
	changed := !statusEquivalent(s.last, next)
	s.last = next
	cb := s.cb
	s.mu.Unlock()
	if !changed {
		return false
	}
	logConditions(ctx, next)
	cb(next.DeepCopy())
	return true
}

func logConditions(ctx context.Context, n *corev1.Node) {
	kv := []any{"node", n.Name}
	for _, c := range n.Status.Conditions {
		kv = append(kv, string(c.Type), string(c.Status)+"/"+c.Reason)
	}
	klog.FromContext(ctx).Info("Node status changed", kv...)
}

// statusEquivalent compares two nodes ignoring condition timestamps.
func statusEquivalent(a, b *corev1.Node) bool {
	sa, sb := a.Status.DeepCopy(), b.Status.DeepCopy()
	for _, s := range []*corev1.NodeStatus{sa, sb} {
		for i := range s.Conditions {
			s.Conditions[i].LastHeartbeatTime = metav1.Time{}
			s.Conditions[i].LastTransitionTime = metav1.Time{}
		}
	}
	return equality.Semantic.DeepEqual(sa, sb) &&
		maps.Equal(a.Labels, b.Labels) && maps.Equal(a.Annotations, b.Annotations)
}
