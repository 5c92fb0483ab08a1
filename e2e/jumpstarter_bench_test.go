package e2e

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/jstest"
)

// BenchmarkJumpstarterLease measures, on the real control plane with the
// test Jumpstarter controller and router, the two latencies a jmp user
// sees: a Lease created -> status.exporterRef, and -> the first DriverCall
// answered through the router (GetReport, then the root driver's
// get_hostname), for a warm set (replicas 1, minAvailable 1: an exporter is
// Online before the lease) and for a set at zero (replicas 0: the lease
// makes a VM boot). Medians over -benchtime iterations (each iteration one
// lease of each kind); x-of-warm = from-zero / warm.
func BenchmarkJumpstarterLease(b *testing.B) {
	e := startExsEnv(b)
	js := e.jumpstarter(b)
	ctx := context.Background()
	warmSet := e.jsSet("jsbw", 1, 1, js)
	zeroSet := e.jsSet("jsbz", 0, 0, js)
	e.createSet(b, warmSet)
	e.createSet(b, zeroSet)

	var warmRef, warmCall, zeroRef, zeroCall []time.Duration
	measure := func(set *v1alpha1.ExporterSet, lease string) (ref, call time.Duration) {
		t0 := js.createLease(b, e.ns, lease, set.Spec.Jumpstarter.ExporterLabels)
		js.waitLease(b, e.ns, lease, 2*vmBoot, "Ready", leaseReady)
		ref = time.Since(t0)
		cctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		sess, err := js.client.Dial(cctx, lease)
		if err != nil {
			b.Fatalf("dial %s: %v", lease, err)
		}
		defer sess.Close()
		rep, err := sess.GetReport(cctx)
		if err != nil {
			b.Fatal(err)
		}
		root, _ := jstest.FindDriver(rep, "")
		if _, err := sess.Call(cctx, root.Uuid, "get_hostname"); err != nil {
			b.Fatalf("get_hostname: %v", err)
		}
		call = time.Since(t0)
		return ref, call
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		// Warm: wait for the set's exporter to be Online and unleased.
		e.waitSet(b, warmSet.Name, 2*vmBoot, "a warm exporter Online", func(s *v1alpha1.ExporterSet, pods []corev1.Pod) bool {
			for _, p := range pods {
				if st, ok := js.ctl.ExporterState(e.ns, p.Name); ok && st.Online && st.Lease == "" && podReady(&p) {
					return true
				}
			}
			return false
		})
		lw := fmt.Sprintf("warm-%d", i)
		r, c := measure(warmSet, lw)
		warmRef, warmCall = append(warmRef, r), append(warmCall, c)

		lz := fmt.Sprintf("zero-%d", i)
		r, c = measure(zeroSet, lz)
		zeroRef, zeroCall = append(zeroRef, r), append(zeroCall, c)

		b.StopTimer()
		js.release(b, e.ns, lw)
		js.release(b, e.ns, lz)
		// Back to zero VMs for the zero set before the next round.
		e.waitSet(b, zeroSet.Name, 2*time.Minute, "no VM", func(s *v1alpha1.ExporterSet, pods []corev1.Pod) bool { return len(pods) == 0 })
		b.StartTimer()
	}
	b.StopTimer()
	med := func(d []time.Duration) float64 {
		s := slices.Clone(d)
		slices.Sort(s)
		return float64(s[len(s)/2].Microseconds()) / 1000
	}
	b.ReportMetric(med(warmRef), "warm-ref-ms")
	b.ReportMetric(med(warmCall), "warm-call-ms")
	b.ReportMetric(med(zeroRef), "zero-ref-ms")
	b.ReportMetric(med(zeroCall), "zero-call-ms")
	b.ReportMetric(med(zeroCall)/med(warmCall), "x-of-warm")
}
