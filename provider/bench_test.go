package provider

import (
	"context"
	"fmt"
	"path/filepath"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// benchEnv is a registry with the test images, an image store holding the
// ACPI image (cached: the benchmarks measure the cached path) and a provider.
type benchEnv struct {
	h        *harness
	stateDir string
	ref      string
	img      *oci.Image
}

func newBenchEnv(b *testing.B) *benchEnv {
	root := b.TempDir()
	vmtest.ReapQEMU(b, root)
	reg := ocitest.StartRegistry(b, ocitest.RegistryOptions{})
	refs := vmtest.PushTestImages(b, reg.Addr)
	imageDir := filepath.Join(root, "images")
	store, err := oci.Open(imageDir, oci.Options{})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { store.Close() })
	img, err := store.Pull(context.Background(), refs[vmtest.VariantACPI], oci.PullOptions{})
	if err != nil {
		b.Fatal(err)
	}
	stateDir := filepath.Join(root, "state")
	return &benchEnv{h: newHarness(b, stateDir, store, imageDir), stateDir: stateDir, ref: refs[vmtest.VariantACPI], img: img}
}

func medianDur(d []time.Duration) time.Duration {
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}

// bareBoot runs the same VM (q35, TCG, 1 vCPU, 256 MiB, kernel + initrd +
// cmdline, pvpanic, user-mode virtio-net) from a bare qemu-system command
// line with the serial console on stdout, until the boot marker.
func (e *benchEnv) bareBoot(b *testing.B) time.Duration {
	b.Helper()
	return testutil.BareBoot(b, "qemu-system-x86_64", vmtest.BootMarker,
		"-machine", "q35,vmport=off", "-accel", "tcg", "-cpu", "max", "-smp", "1", "-m", "256M",
		"-nodefaults", "-no-user-config", "-display", "none", "-serial", "stdio", "-device", "pvpanic",
		"-netdev", "user,id=net0", "-device", "virtio-net-pci,netdev=net0",
		"-kernel", e.img.Kernel, "-initrd", e.img.Initrd, "-append", e.img.Cmdline)
}

// podBoot creates a pod through the provider and returns the time to
// Running (admission, pull check of the cached image, overlay, QEMU start,
// QMP) and to the boot marker on the console; then deletes it.
func (e *benchEnv) podBoot(b *testing.B, uid string) (toRunning, toMarker time.Duration) {
	ctx := context.Background()
	pod := podFor(uid, e.ref, corev1.RestartPolicyAlways, nil)
	start := time.Now()
	if err := e.h.vms.CreatePod(ctx, pod); err != nil {
		b.Fatal(err)
	}
	e.h.wait(pod.UID, 2*time.Minute, "Running", running)
	toRunning = time.Since(start)
	dir := filepath.Join(e.stateDir, VMsDirName, uid)
	waitConsole(b, dir, vmtest.BootMarker, 2*time.Minute)
	toMarker = time.Since(start)
	if err := e.h.vms.DeletePod(ctx, deleting(pod)); err != nil {
		b.Fatal(err)
	}
	waitGoneDir(b, dir, time.Minute)
	return toRunning, toMarker
}

// BenchmarkPodToBootMarker: pod create -> boot marker through the provider
// (image cached) vs a bare qemu-system start of the same VM to the same
// marker, alternating, 3 pairs per iteration. x-of-baseline = pod median /
// bare median; running-ms is create -> Running (pull check, overlay, QEMU
// start, QMP connect), boot-ms the rest (guest boot).
func BenchmarkPodToBootMarker(b *testing.B) {
	e := newBenchEnv(b)
	var pod, bare, run []time.Duration
	n := 0
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j := 0; j < 3; j++ {
			n++
			if j%2 == 0 {
				bare = append(bare, e.bareBoot(b))
			}
			r, m := e.podBoot(b, fmt.Sprintf("bench-%d", n))
			run, pod = append(run, r), append(pod, m)
			if j%2 == 1 {
				bare = append(bare, e.bareBoot(b))
			}
		}
	}
	b.StopTimer()
	mp, mb, mr := medianDur(pod), medianDur(bare), medianDur(run)
	b.ReportMetric(float64(mp.Milliseconds()), "pod-ms")
	b.ReportMetric(float64(mb.Milliseconds()), "bare-ms")
	b.ReportMetric(float64(mr.Milliseconds()), "running-ms")
	b.ReportMetric(float64((mp - mr).Milliseconds()), "boot-ms")
	b.ReportMetric(float64(mp)/float64(mb), "x-of-baseline")
}

// BenchmarkTenPodsAtOnce: 10 pods created at once on one node (image
// cached), time until all are Running (Ready) and until all printed the
// boot marker; baseline in the same run: one pod alone to Running.
// x-of-baseline = all-Ready time / single pod's.
func BenchmarkTenPodsAtOnce(b *testing.B) {
	e := newBenchEnv(b)
	ctx := context.Background()
	var allReady, allBooted, single []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		r, _ := e.podBoot(b, fmt.Sprintf("one-%d", i))
		single = append(single, r)

		var pods []*corev1.Pod
		for k := 0; k < 10; k++ {
			pods = append(pods, podFor(fmt.Sprintf("ten-%d-%d", i, k), e.ref, corev1.RestartPolicyAlways, nil))
		}
		start := time.Now()
		var wg sync.WaitGroup
		for _, p := range pods {
			wg.Add(1)
			go func(p *corev1.Pod) {
				defer wg.Done()
				if err := e.h.vms.CreatePod(ctx, p); err != nil {
					b.Error(err)
				}
			}(p)
		}
		wg.Wait()
		for _, p := range pods {
			e.h.wait(p.UID, 5*time.Minute, "Running", running)
		}
		allReady = append(allReady, time.Since(start))
		for _, p := range pods {
			waitConsole(b, filepath.Join(e.stateDir, VMsDirName, string(p.UID)), vmtest.BootMarker, 5*time.Minute)
		}
		allBooted = append(allBooted, time.Since(start))
		for _, p := range pods {
			if err := e.h.vms.DeletePod(ctx, deleting(p)); err != nil {
				b.Fatal(err)
			}
		}
		for _, p := range pods {
			waitGoneDir(b, filepath.Join(e.stateDir, VMsDirName, string(types.UID(p.UID))), 2*time.Minute)
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(medianDur(allReady).Milliseconds()), "all-ready-ms")
	b.ReportMetric(float64(medianDur(allBooted).Milliseconds()), "all-booted-ms")
	b.ReportMetric(float64(medianDur(single).Milliseconds()), "one-ready-ms")
	b.ReportMetric(float64(medianDur(allReady))/float64(medianDur(single)), "x-of-baseline")
}
