package e2e

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/e2e/jsfake"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/jstest"
)

// BenchmarkJumpstarterLease measures, on the real control plane (node
// agent with real VMs, the ExporterSet controller, the jstest Jumpstarter
// controller and router, jsfake for the Exporter and Lease objects), the
// two latencies a jmp user sees: a Lease created -> status.exporterRef
// (ref), and -> the first DriverCall answered through the router (call:
// Dial, GetReport, then the root driver's get_hostname), for three sets of
// the same template:
//
//   - warm: replicas 1, minAvailable 0: an unleased Ready VM with its
//     exporter Online waits for the lease;
//   - zero: replicas 0, minAvailable 0: the lease makes the set create a
//     VM that boots; its exporter registers once the pod is Ready;
//   - snap: as zero, with qemu-kubelet.io/start-from-snapshot in the
//     template: the VM is restored from a memory snapshot made before the
//     timer starts by an earlier pod of the set (untimed).
//
// Each iteration takes QK_BENCH_JS_LEASES (default 3) leases of each kind,
// one at a time in the order warm, zero, snap; before each the node is
// quiet (the warm set's one VM Ready and Online, no other VM), after each
// the lease is released and its VM (Replace) is gone. Reported: medians
// (<kind>-ref-ms, <kind>-call-ms), spreads max-min (<kind>-ref-spread-ms,
// ...), and the ratios <kind>-ref-x-of-warm, <kind>-call-x-of-warm and
// snap-ref-x-of-zero, snap-call-x-of-zero (the snapshot's gain over a
// boot). The benchmark fails if a snap VM was not restored.
func BenchmarkJumpstarterLease(b *testing.B) {
	leases := envPositive(b, "QK_BENCH_JS_LEASES", 3)
	e := startExsEnv(b)
	js := e.jumpstarter(b)
	ctx := context.Background()
	warmSet := e.jsSet("jsbw", 1, 0, js)
	zeroSet := e.jsSet("jsbz", 0, 0, js)
	snapSet := e.jsSnapSet("jsbs", 0, 0, js)
	for _, s := range []*v1alpha1.ExporterSet{warmSet, zeroSet, snapSet} {
		e.createSet(b, s)
	}
	saved := e.makeSnapshot(b, js, snapSet.Name)
	b.Logf("snapshot: %s", saved)

	kinds := []struct {
		name string
		set  *v1alpha1.ExporterSet
	}{{"warm", warmSet}, {"zero", zeroSet}, {"snap", snapSet}}
	ref := map[string][]time.Duration{}
	call := map[string][]time.Duration{}

	// quiet waits until the warm set has its one Ready VM with an unleased
	// Online exporter and the other sets have no VM.
	quiet := func() {
		e.waitSet(b, warmSet.Name, 2*vmBoot, "one warm exporter Online", func(_ *v1alpha1.ExporterSet, pods []corev1.Pod) bool {
			if len(pods) != 1 || !podReady(&pods[0]) {
				return false
			}
			st, ok := js.ctl.ExporterState(e.ns, pods[0].Name)
			return ok && st.Online && st.Lease == ""
		})
		for _, s := range []string{zeroSet.Name, snapSet.Name} {
			e.waitSet(b, s, 2*time.Minute, "no VM", func(_ *v1alpha1.ExporterSet, pods []corev1.Pod) bool { return len(pods) == 0 })
		}
	}
	measure := func(set *v1alpha1.ExporterSet, lease string) (r, c time.Duration, exporter string) {
		// A watch, not polling: the warm figure is ~0.1 s, a poll's period.
		wctx, wcancel := context.WithTimeout(ctx, 2*vmBoot)
		defer wcancel()
		w, err := js.dyn.Resource(jsfake.LeaseGVR).Namespace(e.ns).Watch(wctx, metav1.ListOptions{
			FieldSelector: fields.OneTermEqualSelector("metadata.name", lease).String()})
		if err != nil {
			b.Fatalf("watch lease %s: %v", lease, err)
		}
		defer w.Stop()
		pw, err := e.c.Client().CoreV1().Pods(e.ns).Watch(wctx, metav1.ListOptions{LabelSelector: "app=" + set.Name})
		if err != nil {
			b.Fatalf("watch pods of %s: %v", set.Name, err)
		}
		defer pw.Stop()
		t0 := js.createLease(b, e.ns, lease, set.Spec.Jumpstarter.ExporterLabels)
		stagesDone := make(chan podStages, 1)
		go func() { stagesDone <- watchPodStages(pw.ResultChan(), t0) }()
		defer func() {
			pw.Stop()
			if st := <-stagesDone; st.created > 0 { // a pod was made for the lease
				b.Logf("%s: pod created +%s, scheduled +%s, Ready +%s; exporterRef +%s; first call +%s",
					lease, msStr(st.created), msStr(st.bound), msStr(st.ready), msStr(r), msStr(c))
			}
		}()
		var l *unstructured.Unstructured
		for ev := range w.ResultChan() {
			if u, ok := ev.Object.(*unstructured.Unstructured); ok && ev.Type != watch.Error && leaseReady(u) {
				l = u
				break
			}
		}
		if l == nil {
			b.Fatalf("lease %s: no exporterRef within %s (watch ended: %v)", lease, 2*vmBoot, wctx.Err())
		}
		r = time.Since(t0)
		cctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		sess, err := js.client.Dial(cctx, lease)
		if err != nil {
			b.Fatalf("dial %s: %v", lease, err)
		}
		defer sess.Close()
		rep, err := sess.GetReport(cctx)
		if err != nil {
			b.Fatalf("lease %s: GetReport: %v", lease, err)
		}
		root, _ := jstest.FindDriver(rep, "")
		if _, err := sess.Call(cctx, root.Uuid, "get_hostname"); err != nil {
			b.Fatalf("lease %s: get_hostname: %v", lease, err)
		}
		c = time.Since(t0)
		return r, c, leaseExporter(l)
	}

	n := 0
	b.Logf("load average at the first lease: %s", loadAvg())
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j := 0; j < leases; j++ {
			for _, k := range kinds {
				b.StopTimer()
				quiet()
				b.StartTimer()
				n++
				lease := fmt.Sprintf("%s-%d", k.name, n)
				r, c, exp := measure(k.set, lease)
				b.StopTimer()
				ref[k.name] = append(ref[k.name], r)
				call[k.name] = append(call[k.name], c)
				pod, err := e.c.Client().CoreV1().Pods(e.ns).Get(ctx, exp, metav1.GetOptions{})
				if err != nil {
					b.Fatalf("lease %s: exporter %s is no pod: %v", lease, exp, err)
				}
				if k.name == "snap" {
					e.waitPodEvent(b, exp, "Started", "restored from a memory snapshot", 30*time.Second)
				}
				js.release(b, e.ns, lease)
				js.waitLease(b, e.ns, lease, 30*time.Second, "ended", leaseEnded)
				e.waitVMGone(b, *pod, 2*time.Minute)
				b.StartTimer()
			}
		}
	}
	b.StopTimer()
	b.Logf("load average after the last lease: %s", loadAvg())
	for _, k := range kinds {
		b.Logf("%s: ref %s, call %s", k.name, durList(ref[k.name]), durList(call[k.name]))
		b.ReportMetric(medianMs(ref[k.name]), k.name+"-ref-ms")
		b.ReportMetric(medianMs(call[k.name]), k.name+"-call-ms")
		b.ReportMetric(spreadMs(ref[k.name]), k.name+"-ref-spread-ms")
		b.ReportMetric(spreadMs(call[k.name]), k.name+"-call-spread-ms")
	}
	for _, k := range []string{"zero", "snap"} {
		b.ReportMetric(medianMs(ref[k])/medianMs(ref["warm"]), k+"-ref-x-of-warm")
		b.ReportMetric(medianMs(call[k])/medianMs(call["warm"]), k+"-call-x-of-warm")
	}
	b.ReportMetric(medianMs(ref["snap"])/medianMs(ref["zero"]), "snap-ref-x-of-zero")
	b.ReportMetric(medianMs(call["snap"])/medianMs(call["zero"]), "snap-call-x-of-zero")
}

// medianMs is the median of d in milliseconds (the upper one of an even
// count).
func medianMs(d []time.Duration) float64 {
	s := slices.Clone(d)
	slices.Sort(s)
	return float64(s[len(s)/2].Microseconds()) / 1000
}

// spreadMs is max - min of d in milliseconds.
func spreadMs(d []time.Duration) float64 {
	return float64((slices.Max(d) - slices.Min(d)).Microseconds()) / 1000
}

// durList renders d in milliseconds, in measurement order.
func durList(d []time.Duration) string {
	var f []string
	for _, x := range d {
		f = append(f, strconv.FormatFloat(float64(x.Microseconds())/1000, 'f', 1, 64))
	}
	return "[" + strings.Join(f, " ") + "] ms"
}

// podStages are the times after a lease's creation at which a watch first
// saw a pod of the set added, bound to the node, and Ready (0: not seen).
type podStages struct{ created, bound, ready time.Duration }

// watchPodStages reads pod events until ch closes. Pods the watch lists at
// its start (those of a warm set) are ADDED events too: they were there
// before the lease, so only pods created after t0 count.
func watchPodStages(ch <-chan watch.Event, t0 time.Time) podStages {
	var st podStages
	for ev := range ch {
		p, ok := ev.Object.(*corev1.Pod)
		if !ok || p.CreationTimestamp.Time.Before(t0.Truncate(time.Second)) {
			continue
		}
		d := time.Since(t0)
		if st.created == 0 {
			st.created = d
		}
		if st.bound == 0 && p.Spec.NodeName != "" {
			st.bound = d
		}
		if st.ready == 0 && podReady(p) {
			st.ready = d
		}
	}
	return st
}

func msStr(d time.Duration) string { return d.Round(time.Millisecond).String() }
