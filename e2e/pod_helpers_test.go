package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
)

// vmPodSpec is a VM pod for node: tolerates the provider taint, selects the
// node, small requests (the test host has 2 CPUs) and a 1 vCPU/256Mi VM.
func vmPodSpec(name, node, image string, policy corev1.RestartPolicy, ann map[string]string) *corev1.Pod {
	grace := int64(30)
	q := resource.MustParse
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", Annotations: ann},
		Spec: corev1.PodSpec{
			NodeSelector:                  map[string]string{"kubernetes.io/hostname": node},
			Tolerations:                   []corev1.Toleration{{Key: "virtual-kubelet.io/provider", Operator: corev1.TolerationOpEqual, Value: "qemu", Effect: corev1.TaintEffectNoSchedule}},
			RestartPolicy:                 policy,
			TerminationGracePeriodSeconds: &grace,
			Containers: []corev1.Container{{
				Name: "vm", Image: image,
				Resources: corev1.ResourceRequirements{
					Requests: corev1.ResourceList{corev1.ResourceCPU: q("100m"), corev1.ResourceMemory: q("64Mi")},
					Limits:   corev1.ResourceList{corev1.ResourceCPU: q("1"), corev1.ResourceMemory: q("256Mi")},
				},
			}},
		},
	}
}

// shortGrace is the grace period (seconds) of a test pod deleted right
// after a restart, on a guest still booting (acpid not up, the power button
// unheard), where the test checks no graceful stop: the node stops the VM
// after the minimum ACPI budget (1 s) and quits it, where vmPodSpec's 30 s
// would wait 27 s for the guest.
const shortGrace int64 = 2

// podRecorder watches one pod and records the distinct container states
// (phase/reason) it goes through, so a test can assert a sequence without
// racing against fast transitions.
type podRecorder struct {
	mu   sync.Mutex
	tags []string
	last *corev1.Pod
}

func podTag(p *corev1.Pod) string {
	tag := string(p.Status.Phase)
	if len(p.Status.ContainerStatuses) > 0 {
		cs := p.Status.ContainerStatuses[0]
		switch {
		case cs.State.Waiting != nil:
			tag += "/" + cs.State.Waiting.Reason
		case cs.State.Running != nil:
			tag += "/Running"
		case cs.State.Terminated != nil:
			tag += "/" + cs.State.Terminated.Reason
		}
	}
	return tag
}

func recordPod(t *testing.T, c *cluster.Cluster, ns, name string) *podRecorder {
	t.Helper()
	r := &podRecorder{}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	w, err := c.Client().CoreV1().Pods(ns).Watch(ctx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("metadata.name", name).String()})
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		defer w.Stop()
		for ev := range w.ResultChan() {
			p, ok := ev.Object.(*corev1.Pod)
			if !ok || ev.Type == watch.Error {
				continue
			}
			r.mu.Lock()
			if tag := podTag(p); len(r.tags) == 0 || r.tags[len(r.tags)-1] != tag {
				r.tags = append(r.tags, tag)
			}
			r.last = p
			r.mu.Unlock()
		}
	}()
	return r
}

func (r *podRecorder) seen() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.tags...)
}

// waitPod polls the pod until ok or timeout.
func waitPod(t *testing.T, c *cluster.Cluster, ns, name string, timeout time.Duration, what string, ok func(*corev1.Pod) bool) *corev1.Pod {
	t.Helper()
	var last *corev1.Pod
	err := wait.PollUntilContextTimeout(context.Background(), 250*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		p, err := c.Client().CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		last = p
		return ok(p), nil
	})
	if err != nil {
		var st any
		if last != nil {
			st = last.Status
		}
		t.Fatalf("pod %s/%s: waiting for %s: %v; last status %+v", ns, name, what, err, st)
	}
	return last
}

func waitPodGone(t *testing.T, c *cluster.Cluster, ns, name string, timeout time.Duration) {
	t.Helper()
	err := wait.PollUntilContextTimeout(context.Background(), 250*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		_, err := c.Client().CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	})
	if err != nil {
		t.Fatalf("pod %s/%s still in the API server after %s", ns, name, timeout)
	}
}

func podRunning(p *corev1.Pod) bool {
	return p.Status.Phase == corev1.PodRunning && len(p.Status.ContainerStatuses) == 1 && p.Status.ContainerStatuses[0].State.Running != nil
}

func podTerminated(p *corev1.Pod) *corev1.ContainerStateTerminated {
	if len(p.Status.ContainerStatuses) != 1 {
		return nil
	}
	return p.Status.ContainerStatuses[0].State.Terminated
}

// vmDir is the pod's state dir on the node.
func (a *nodeAgent) vmDir(uid string) string { return filepath.Join(a.dir, "state", "vms", uid) }

func waitFileContains(t *testing.T, path, marker string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		b, _ := os.ReadFile(path)
		if strings.Contains(string(b), marker) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: no %q within %s:\n%s", path, marker, timeout, tail(string(b), 30))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func waitNoDir(t *testing.T, dir string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		_, err := os.Stat(dir)
		if os.IsNotExist(err) && len(vmtest.QEMUPids(dir)) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: state dir or QEMU still there after %s (QEMU pids %v)", dir, timeout, vmtest.QEMUPids(dir))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// deleteAllPods deletes every pod in ns and waits until they are gone and
// no QEMU runs under dir.
func deleteAllPods(t *testing.T, c *cluster.Cluster, ns, dir string) {
	ctx := context.Background()
	_ = c.Client().CoreV1().Pods(ns).DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})
	_ = wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		l, err := c.Client().CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		return err == nil && len(l.Items) == 0 && len(vmtest.QEMUPids(dir)) == 0, nil
	})
}

func containsSeq(seen []string, want ...string) error {
	i := 0
	for _, s := range seen {
		if i < len(want) && s == want[i] {
			i++
		}
	}
	if i < len(want) {
		return fmt.Errorf("statuses %v do not contain %v in order", seen, want)
	}
	return nil
}
