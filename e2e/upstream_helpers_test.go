package e2e

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	vtv1 "github.com/qemu-kubelet/qemu-kubelet/api/virtualtarget/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/controller"
	"github.com/qemu-kubelet/qemu-kubelet/e2e/jsfake"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/jstest"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
)

// upstreamRun is what startUpstream set up for TestUpstreamExporterSet.
type upstreamRun struct {
	logPath string // the provisioner's log
	rawDisk string // a bootable raw disk (xz) for a lease to flash onto root
	other   *vtv1.ExporterSet
	otherRV string // the other provisioner's set as created
}

// startUpstream installs upstream's CRDs, the CA ConfigMap, our class
// (no image: empty disks of 128Mi) and theirs, the set up (minReplicas 0,
// ExitAndReplace) and the other provisioner's set, then starts the
// provisioner and waits for its /healthz.
func (e *exsEnv) startUpstream(t *testing.T, js *jsEnv) upstreamRun {
	t.Helper()
	ctx := context.Background()
	e.installUpstreamAPI(t, js)
	run := upstreamRun{rawDisk: bootableRawDisk(t)}

	sched := &vtv1.SchedulingSpec{
		NodeSelector: map[string]string{"kubernetes.io/hostname": e.node},
		Tolerations:  []corev1.Toleration{{Key: "virtual-kubelet.io/provider", Operator: corev1.TolerationOpEqual, Value: "qemu", Effect: corev1.TaintEffectNoSchedule}},
		Resources: &corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"),
			corev1.ResourceMemory: resource.MustParse("64Mi")}},
	}
	ours := &vtv1.VirtualTargetClass{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "qk"}, Spec: vtv1.VirtualTargetClassSpec{
		Provisioner: vtv1.DefaultProvisioner, Scheduling: sched,
		Parameters: &apiextv1.JSON{Raw: []byte(`{"resources":{"cpu":"1","memory":"256Mi","storage":"128Mi"}}`)}}}
	theirs := &vtv1.VirtualTargetClass{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "qemu"}, Spec: vtv1.VirtualTargetClassSpec{
		Provisioner: "qemu.jumpstarter.dev", Parameters: &apiextv1.JSON{Raw: []byte(`{"arch":"x86_64"}`)}}}
	labels := map[string]string{"board": "qemu-up", "virtual": "true"}
	set := &vtv1.ExporterSet{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "up"}, Spec: vtv1.ExporterSetSpec{
		MinReplicas: 0, MaxReplicas: ptr.To[int32](2), RecycleStrategy: vtv1.RecycleStrategyExitAndReplace,
		ScaleDownCooldown: &metav1.Duration{Duration: 3 * time.Second}, VirtualTargetClassName: "qk",
		Selector: metav1.LabelSelector{MatchLabels: labels},
		Template: vtv1.ExporterSetTemplate{Metadata: vtv1.TemplateMetadata{Labels: labels}, Spec: vtv1.ExporterTemplateSpec{Drivers: []vtv1.DriverConfig{
			{Name: "qemu", Type: controller.DriverTypeQemu, Config: &apiextv1.JSON{Raw: []byte(`{"smp":1,"mem":"256M","hostfwd":{"http":{"guestport":8080}}}`)}},
			{Name: "power", Type: controller.DriverTypeQemuPower},
			{Name: "console", Type: controller.DriverTypeQemuSerial},
			{Name: "flasher", Type: controller.DriverTypeQemuFlasher},
		}}}}}
	run.other = &vtv1.ExporterSet{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "other"}, Spec: vtv1.ExporterSetSpec{
		MinReplicas: 1, VirtualTargetClassName: "qemu", Selector: metav1.LabelSelector{MatchLabels: map[string]string{"board": "theirs"}},
		Template: vtv1.ExporterSetTemplate{Metadata: vtv1.TemplateMetadata{Labels: map[string]string{"board": "theirs"}}}}}
	for _, o := range []client.Object{ours, theirs, run.other, set} {
		require.NoError(t, e.cl.Create(ctx, o), "create %s", o.GetName())
	}
	require.NoError(t, e.cl.Get(ctx, client.ObjectKeyFromObject(run.other), run.other))
	run.otherRV = run.other.ResourceVersion

	run.logPath = e.runProvisioner(t, "up")
	return run
}

// installUpstreamAPI installs upstream's CRDs and the CA ConfigMap the
// provisioner reads. After our own controller started (it then serves
// our API alone): the provisioner serves upstream's.
func (e *exsEnv) installUpstreamAPI(tb testing.TB, js *jsEnv) {
	tb.Helper()
	e.installUpstreamCRDs(tb)
	_, err := e.c.Client().CoreV1().ConfigMaps(e.ns).Create(context.Background(), &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "jumpstarter-service-ca-cert"},
		Data: map[string]string{"ca.crt": string(js.ctl.CABundle())}}, metav1.CreateOptions{})
	require.NoError(tb, err)
}

// runProvisioner starts the provisioner (startProvisioner), has the
// upstream set named set deleted before it stops (cleanups are LIFO: the
// set goes, the garbage collector deletes its pods, the node stops their
// VMs) and waits for its /healthz. It returns the provisioner's log.
func (e *exsEnv) runProvisioner(tb testing.TB, set string) string {
	tb.Helper()
	logPath, health := e.startProvisioner(tb)
	tb.Cleanup(func() { e.deleteUpstreamSet(tb, set) })
	require.Eventually(tb, func() bool {
		resp, err := http.Get("http://" + health + "/healthz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, 30*time.Second, 200*time.Millisecond, "/healthz on the probe address")
	return logPath
}

// bootableRawDisk is the test image's firmware-bootable disk
// (hack/build-test-image.sh: SYSLINUX, the test kernel and its acpi
// initramfs) as a raw file, xz-compressed as a client would send it.
func bootableRawDisk(t *testing.T) string {
	t.Helper()
	raw := filepath.Join(t.TempDir(), "disk.raw")
	out, err := exec.Command("qemu-img", "convert", "-q", "-f", "qcow2", "-O", "raw", filepath.Join(vmtest.BuildTestImages(t), "disk.qcow2"), raw).CombinedOutput()
	require.NoError(t, err, "%s", out)
	out, err = exec.Command("xz", "-1", "-k", raw).CombinedOutput()
	require.NoError(t, err, "%s", out)
	return raw
}

// flashRoot flashes the raw disk raw (its .xz, as bootableRawDisk made it)
// onto root through the lease, as `j flasher flash` does, and returns the
// digest of the raw bytes (the flashed root's imageID digest).
func (e *exsEnv) flashRoot(t *testing.T, js *jsEnv, lease, raw string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	b, err := os.ReadFile(raw)
	require.NoError(t, err)
	sum := sha256.Sum256(b)
	sess, err := js.client.Dial(ctx, lease)
	require.NoError(t, err, "dial lease %s", lease)
	defer sess.Close()
	rep, err := sess.GetReport(ctx)
	require.NoError(t, err)
	flasher, ok := jstest.FindDriver(rep, "flasher")
	require.True(t, ok, "the flasher driver in the report")
	src, err := os.Open(raw + ".xz")
	require.NoError(t, err)
	defer src.Close()
	require.NoError(t, sess.Flash(ctx, flasher.Uuid, src, "root", ""), "flash root through lease %s", lease)
	return "sha256:" + hex.EncodeToString(sum[:])
}

// waitImageID waits until the pod's container imageID starts with prefix.
func (e *exsEnv) waitImageID(t *testing.T, pod, prefix string, timeout time.Duration) {
	t.Helper()
	var last string
	deadline := time.Now().Add(timeout)
	for {
		p, err := e.c.Client().CoreV1().Pods(e.ns).Get(context.Background(), pod, metav1.GetOptions{})
		if err == nil && len(p.Status.ContainerStatuses) == 1 {
			last = p.Status.ContainerStatuses[0].ImageID
			if strings.HasPrefix(last, prefix) {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("pod %s: imageID %q, not %s..., after %s", pod, last, prefix, timeout)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// upstreamExitAndReplace: with minReplicas 1, the release of u1 retires
// the used VM (ExitAndReplace) and its Secret; a fresh one replaces it.
func (e *exsEnv) upstreamExitAndReplace(t *testing.T, js *jsEnv, used corev1.Pod) {
	t.Helper()
	ctx := context.Background()
	e.patchUpstream(t, "up", `{"spec":{"minReplicas":1}}`)
	js.release(t, e.ns, "u1")
	js.waitLease(t, e.ns, "u1", 30*time.Second, "ended", leaseEnded)
	e.waitVMGone(t, used, 2*time.Minute)
	require.Eventually(t, func() bool {
		ps := e.upstreamPods(t, "up")
		if len(ps) != 1 || ps[0].Name == used.Name {
			return false
		}
		st, ok := js.ctl.ExporterState(e.ns, ps[0].Name)
		return ok && st.Online
	}, 2*vmBoot, time.Second, "a fresh VM replaces the used one, its exporter Online")
	_, err := e.c.Client().CoreV1().Secrets(e.ns).Get(ctx, "exporter-config-"+used.Name, metav1.GetOptions{})
	assert.True(t, apierrors.IsNotFound(err), "the used VM's Secret went with its pod: %v", err)
}

// upstreamInPlaceReuse: under InPlaceReuse (its own pods: the template
// changed) a lease flashes root; its release keeps the pod (same UID),
// which goes through AFTER_LEASE_HOOK, is reset to its empty disk and
// reports Available again; no VM is added.
func (e *exsEnv) upstreamInPlaceReuse(t *testing.T, js *jsEnv, raw string) {
	t.Helper()
	e.patchUpstream(t, "up", `{"spec":{"recycleStrategy":"InPlaceReuse"}}`)
	var pod corev1.Pod
	require.Eventually(t, func() bool {
		ps := e.upstreamPods(t, "up")
		if len(ps) != 1 || ps[0].Annotations[v1alpha1.LeaseStatePolicyAnnotation] != "" {
			return false
		}
		pod = ps[0]
		st, ok := js.ctl.ExporterState(e.ns, pod.Name)
		return ok && st.Online && st.Status == pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE
	}, 2*vmBoot, time.Second, "an InPlaceReuse VM (no Keep lease state policy) Available")
	js.createLease(t, e.ns, "u2", map[string]string{"board": "qemu-up"})
	l2 := js.waitLease(t, e.ns, "u2", time.Minute, "Ready", leaseReady)
	require.Equal(t, pod.Name, leaseExporter(l2))
	digest := e.flashRoot(t, js, "u2", raw)
	e.waitImageID(t, pod.Name, "flash/root@"+digest, 2*time.Minute)
	js.release(t, e.ns, "u2")
	js.waitLease(t, e.ns, "u2", 30*time.Second, "ended", leaseEnded)

	var st jstest.ExporterState
	require.Eventually(t, func() bool {
		var ok bool
		st, ok = js.ctl.ExporterState(e.ns, pod.Name)
		return ok && st.Online && st.Lease == "" && st.Status == pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE &&
			slices.Contains(st.StatusHistory, pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK)
	}, 2*time.Minute, 500*time.Millisecond, "the released exporter through AFTER_LEASE_HOOK, Available again")
	e.waitImageID(t, pod.Name, v1alpha1.EmptyDiskImage+"@sha256:", time.Minute)
	ps := e.upstreamPods(t, "up")
	require.Len(t, ps, 1, "no VM added")
	assert.Equal(t, pod.UID, ps[0].UID, "InPlaceReuse: the same pod")
	e.waitUpstream(t, "up", time.Minute, "1 replica, none leased", func(s vtv1.ExporterSetStatus) bool {
		return s.Replicas == 1 && s.LeasedReplicas == 0
	})
}

// exporterEvent is one event of a watch of the set's Exporters.
type exporterEvent struct {
	typ     watch.EventType
	name    string
	enabled bool
}

// watchExporters records the events of the set's Exporters until the
// test ends; the func returns those seen so far.
func (e *exsEnv) watchExporters(t *testing.T, js *jsEnv, set string) func() []exporterEvent {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	w, err := js.dyn.Resource(jsfake.ExporterGVR).Namespace(e.ns).Watch(ctx, metav1.ListOptions{LabelSelector: controller.UpstreamExporterSetLabel + "=" + set})
	require.NoError(t, err)
	var mu sync.Mutex
	var seen []exporterEvent
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ev := range w.ResultChan() {
			u, ok := ev.Object.(*unstructured.Unstructured)
			if !ok {
				continue
			}
			en, found, _ := unstructured.NestedBool(u.Object, "spec", "enabled")
			mu.Lock()
			seen = append(seen, exporterEvent{typ: ev.Type, name: u.GetName(), enabled: en || !found})
			mu.Unlock()
		}
	}()
	t.Cleanup(func() { cancel(); w.Stop(); <-done })
	return func() []exporterEvent {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(seen)
	}
}

// upstreamScaleDown: with two VMs, one leased, minReplicas 0 disables the
// idle VM's Exporter before it is deleted and never disables the leased
// one while the lease holds it; once released, it goes too.
func (e *exsEnv) upstreamScaleDown(t *testing.T, js *jsEnv) {
	t.Helper()
	e.patchUpstream(t, "up", `{"spec":{"minReplicas":2}}`)
	require.Eventually(t, func() bool {
		ps := e.upstreamPods(t, "up")
		if len(ps) != 2 {
			return false
		}
		for _, p := range ps {
			st, ok := js.ctl.ExporterState(e.ns, p.Name)
			if !ok || !st.Online || st.Status != pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE {
				return false
			}
		}
		return true
	}, 2*vmBoot, time.Second, "two VMs, both exporters Available")
	js.createLease(t, e.ns, "u3", map[string]string{"board": "qemu-up"})
	leased := leaseExporter(js.waitLease(t, e.ns, "u3", time.Minute, "Ready", leaseReady))
	var idle corev1.Pod
	for _, p := range e.upstreamPods(t, "up") {
		if p.Name != leased {
			idle = p
		}
	}
	require.NotEmpty(t, idle.Name, "the idle VM")
	seen := e.watchExporters(t, js, "up")
	e.patchUpstream(t, "up", `{"spec":{"minReplicas":0}}`)
	e.waitVMGone(t, idle, 2*time.Minute)
	require.Eventually(t, func() bool {
		return slices.ContainsFunc(seen(), func(ev exporterEvent) bool { return ev.typ == watch.Deleted && ev.name == idle.Name })
	}, time.Minute, 250*time.Millisecond, "the idle VM's Exporter deleted")
	held := seen()
	disabledAt, deletedAt := -1, -1
	for i, ev := range held {
		switch {
		case ev.name == idle.Name && !ev.enabled && ev.typ == watch.Modified && disabledAt < 0:
			disabledAt = i
		case ev.name == idle.Name && ev.typ == watch.Deleted:
			deletedAt = i
		}
		assert.False(t, ev.name == leased && !ev.enabled, "the leased VM's Exporter disabled while held: %+v", ev)
	}
	assert.True(t, disabledAt >= 0 && disabledAt < deletedAt, "the idle Exporter disabled (event %d) before deleted (event %d): %+v", disabledAt, deletedAt, held)
	t.Logf("exporter events of the scale-down (idle %s, leased %s): %+v", idle.Name, leased, held)
	assert.Len(t, e.upstreamPods(t, "up"), 1, "the leased VM stays while held")

	js.release(t, e.ns, "u3")
	js.waitLease(t, e.ns, "u3", 30*time.Second, "ended", leaseEnded)
	require.Eventually(t, func() bool { return len(e.upstreamPods(t, "up")) == 0 }, 2*time.Minute, time.Second,
		"at minReplicas 0 the released VM goes too")
}

// patchUpstream merge-patches the upstream set name.
func (e *exsEnv) patchUpstream(t *testing.T, name, patch string) {
	t.Helper()
	err := e.cl.Patch(context.Background(), &vtv1.ExporterSet{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name}},
		client.RawPatch(types.MergePatchType, []byte(patch)))
	require.NoError(t, err, fmt.Sprintf("patch exporterset %s with %s", name, patch))
}
