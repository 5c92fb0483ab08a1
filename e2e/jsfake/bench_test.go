package jsfake

import (
	"context"
	"fmt"
	"sort"
	"testing"
	"time"

	"github.com/go-logr/logr"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/jstest"
)

// BenchmarkLeaseToExporterRef measures, through the ExporterSet controller,
// jsfake and jstest, the time from a Lease's creation to its exporterRef for
// a warm set (minAvailable 1: an online exporter waits) and from zero
// (replicas 0: the Lease waits on the cold exporter while a pod is created,
// released from its gate, and its exporter comes online). The fake node
// boots instantly, so from-zero-ms is the controller's and Jumpstarter's
// own overhead; a real VM adds its boot time (the node e2e measures that).
func BenchmarkLeaseToExporterRef(b *testing.B) {
	if testing.Short() {
		b.Skip("needs the control plane")
	}
	ns := env.namespace(b)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ctl, err := jstest.Start(jstest.Options{Insecure: true})
	if err != nil {
		b.Fatal(err)
	}
	defer ctl.Close()
	fake := &Fake{Client: env.client, Ctl: ctl, Namespace: ns, Interval: 50 * time.Millisecond, Log: logr.Discard()}
	go fake.Run(ctx)
	node := &fakeNode{c: env.client, ns: ns, app: "bench", running: map[types.UID]func(){}, booted: map[string]time.Time{}}
	go node.run(ctx, b)
	startController(b, &env, ns)

	set := &v1alpha1.ExporterSet{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "bench"},
		Spec: v1alpha1.ExporterSetSpec{
			Replicas: ptr.To(int32(0)), MinAvailable: ptr.To(int32(0)),
			Selector:          &metav1.LabelSelector{MatchLabels: map[string]string{"app": "bench"}},
			ScaleDownCooldown: &metav1.Duration{},
			Jumpstarter:       &v1alpha1.JumpstarterSpec{ExporterLabels: map[string]string{"board": "bench"}},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": "bench"}},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "vm", Image: "registry.invalid/os:1"}}},
			},
		},
	}
	if err := env.client.Create(ctx, set); err != nil {
		b.Fatal(err)
	}
	// A Lease made before the cold exporter exists is Unsatisfiable at once.
	eventually(b, "cold exporter", func() (bool, string) {
		var e jsv1.Exporter
		err := env.client.Get(ctx, types.NamespacedName{Namespace: ns, Name: "bench-cold"}, &e)
		return err == nil, fmt.Sprint(err)
	})
	livePods := func() int {
		var l corev1.PodList
		_ = env.client.List(ctx, &l, client.InNamespace(ns), client.MatchingLabels{"app": "bench"})
		n := 0
		for _, p := range l.Items {
			if p.DeletionTimestamp == nil {
				n++
			}
		}
		return n
	}
	freeOnline := func() bool {
		var el jsv1.ExporterList
		_ = env.client.List(ctx, &el, client.InNamespace(ns), client.MatchingLabels{v1alpha1.ExporterSetLabel: "bench"})
		for _, e := range el.Items {
			if e.IsEnabled() && e.Status.LeaseRef == nil && meta.IsStatusConditionTrue(e.Status.Conditions, jsv1.ExporterConditionOnline) {
				return true
			}
		}
		return false
	}
	n := 0
	once := func(ready func() bool) time.Duration {
		eventually(b, "set ready for the next lease", func() (bool, string) { return ready(), "" })
		n++
		name := fmt.Sprintf("l%d", n)
		start := time.Now()
		if err := env.client.Create(ctx, &jsv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
			Spec: jsv1.LeaseSpec{ClientRef: corev1.LocalObjectReference{Name: "ci"}, Selector: metav1.LabelSelector{MatchLabels: map[string]string{"board": "bench"}},
				Duration: &metav1.Duration{Duration: time.Hour}}}); err != nil {
			b.Fatal(err)
		}
		var l jsv1.Lease
		for {
			if err := env.client.Get(ctx, types.NamespacedName{Namespace: ns, Name: name}, &l); err == nil && l.Status.ExporterRef != nil {
				break
			}
			if l.Status.Ended || time.Since(start) > time.Minute {
				b.Fatalf("lease %s: %v", name, l.Status.Conditions)
			}
			time.Sleep(5 * time.Millisecond)
		}
		d := time.Since(start)
		l.Spec.Release = true
		if err := env.client.Update(ctx, &l); err != nil {
			b.Fatal(err)
		}
		return d
	}
	median := func(ds []time.Duration) time.Duration {
		sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
		return ds[len(ds)/2]
	}
	const rounds = 3
	var zero, warm []time.Duration
	for b.Loop() {
		for range rounds {
			zero = append(zero, once(func() bool { return livePods() == 0 }))
		}
	}
	if err := env.client.Patch(ctx, set, client.RawPatch(types.MergePatchType, []byte(`{"spec":{"minAvailable":1}}`))); err != nil {
		b.Fatal(err)
	}
	for range rounds * max(1, len(zero)/rounds) {
		warm = append(warm, once(freeOnline))
	}
	z, w := median(zero), median(warm)
	b.ReportMetric(float64(z.Microseconds())/1000, "from-zero-ms")
	b.ReportMetric(float64(w.Microseconds())/1000, "warm-ms")
	b.ReportMetric(float64(z)/float64(w), "zero-x-of-warm")
}
