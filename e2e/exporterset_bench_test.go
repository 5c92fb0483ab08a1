package e2e

import (
	"context"
	"fmt"
	"time"

	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

// BenchmarkLease compares, in one run on the same node, getting a Ready
// target by leasing one from an ExporterSet's warm buffer against a cold
// start (create a VM pod -> Ready). DESIGN §9: the lease should be at least
// 100x faster.
//
// One iteration: a cold start of a pod with the set's template (timed from
// the create call to the Ready condition seen on a watch), then a lease
// (timed from the list of claimable pods to the answer of the claim patch,
// which returns the Ready pod), then untimed cleanup (the cold pod deleted,
// the leased pod released by deletion, the buffer refilled). The benchmark
// timer runs over whole iterations (tens of seconds each), so the default
// -benchtime=1s makes a single iteration; -benchtime=3x averages three.
//
// Metrics: cold-ms and lease-ms (means), x-of-baseline = cold / lease, and
// lease-kubectl-ms: the same claim made by the documented shell recipe
// (bash, two kubectl runs, jq), for a client without a Go API client.
func BenchmarkLease(b *testing.B) {
	e := startExsEnv(b)
	ctx := context.Background()
	const name = "bench"
	set := e.newSet(name, e.image, 0, 1)
	e.createSet(b, set)
	warm := counts{1, 1, 1, 1, 0}
	e.waitCounts(b, name, warm, 2*vmBoot)

	var cold, lease, leaseKubectl time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		// Cold start: a standalone pod from the same template.
		cp := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("cold-%d", i), Namespace: e.ns}, Spec: set.Spec.Template.Spec}
		d, pod := e.coldStart(b, cp)
		cold += d
		if err := e.c.Client().CoreV1().Pods(e.ns).Delete(ctx, pod.Name, metav1.DeleteOptions{}); err != nil {
			b.Fatal(err)
		}
		e.waitVMGone(b, *pod, 90*time.Second)

		// Lease from the warm buffer with the API client.
		start := time.Now()
		leased, err := e.claimAPI(ctx, name, "bench")
		lease += time.Since(start)
		if err != nil {
			b.Fatal(err)
		}
		if !podReady(leased) {
			b.Fatalf("leased pod %s is not Ready", leased.Name)
		}
		e.release(b, name, leased, warm)

		// The same with the documented kubectl recipe.
		start = time.Now()
		podName := e.claim(b, name, "bench-kubectl")
		leaseKubectl += time.Since(start)
		p, err := e.c.Client().CoreV1().Pods(e.ns).Get(ctx, podName, metav1.GetOptions{})
		if err != nil {
			b.Fatal(err)
		}
		if !podReady(p) {
			b.Fatalf("leased pod %s is not Ready", p.Name)
		}
		e.release(b, name, p, warm)
	}
	b.StopTimer()
	n := float64(b.N)
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 / n }
	b.ReportMetric(ms(cold), "cold-ms")
	b.ReportMetric(ms(lease), "lease-ms")
	b.ReportMetric(ms(leaseKubectl), "lease-kubectl-ms")
	b.ReportMetric(float64(cold)/float64(lease), "x-of-baseline")
	b.ReportMetric(float64(cold)/float64(leaseKubectl), "kubectl-x-of-baseline")
}

// coldStart creates p and returns the time from the create call until a
// watch shows it Ready, and the Ready pod.
func (e *exsEnv) coldStart(tb testing.TB, p *corev1.Pod) (time.Duration, *corev1.Pod) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), vmBoot)
	defer cancel()
	w, err := e.c.Client().CoreV1().Pods(e.ns).Watch(ctx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("metadata.name", p.Name).String()})
	if err != nil {
		tb.Fatal(err)
	}
	defer w.Stop()
	start := time.Now()
	if _, err := e.c.Client().CoreV1().Pods(e.ns).Create(ctx, p, metav1.CreateOptions{}); err != nil {
		tb.Fatal(err)
	}
	for ev := range w.ResultChan() {
		if pod, ok := ev.Object.(*corev1.Pod); ok && ev.Type != watch.Error && podReady(pod) {
			return time.Since(start), pod
		}
	}
	tb.Fatalf("pod %s not Ready within %s", p.Name, vmBoot)
	return 0, nil
}

// claimAPI is the documented claim recipe done with the API client: list
// the set's pods that carry neither the lease nor the used label, take a
// Ready one, label it with its resourceVersion as precondition. It returns
// the claimed pod as the API server answered the patch.
func (e *exsEnv) claimAPI(ctx context.Context, set, me string) (*corev1.Pod, error) {
	sel := fmt.Sprintf("app=%s,!%s,!%s", set, v1alpha1.LeaseLabel, v1alpha1.UsedLabel)
	l, err := e.c.Client().CoreV1().Pods(e.ns).List(ctx, metav1.ListOptions{LabelSelector: sel})
	if err != nil {
		return nil, fmt.Errorf("list claimable pods of %s: %w", set, err)
	}
	for _, p := range l.Items {
		if p.DeletionTimestamp != nil || !podReady(&p) {
			continue
		}
		patch := fmt.Appendf(nil, `{"metadata":{"resourceVersion":%q,"labels":{%q:%q,%q:"true"}}}`,
			p.ResourceVersion, v1alpha1.LeaseLabel, me, v1alpha1.UsedLabel)
		return e.c.Client().CoreV1().Pods(e.ns).Patch(ctx, p.Name, types.MergePatchType, patch, metav1.PatchOptions{})
	}
	return nil, fmt.Errorf("no Ready unleased pod in %s", set)
}

// release deletes the leased pod (a Replace release), waits until its VM is
// gone and the set is back at want.
func (e *exsEnv) release(tb testing.TB, set string, p *corev1.Pod, want counts) {
	tb.Helper()
	if err := e.c.Client().CoreV1().Pods(e.ns).Delete(context.Background(), p.Name, metav1.DeleteOptions{}); err != nil {
		tb.Fatal(err)
	}
	e.waitVMGone(tb, *p, 90*time.Second)
	e.waitCounts(tb, set, want, vmBoot)
}
