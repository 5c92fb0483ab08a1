package e2e

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr/testr"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/dynamic"
	"sigs.k8s.io/controller-runtime/pkg/client"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/e2e/jsfake"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/jstest"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/snapshot"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// jsEnv is the Jumpstarter side of an exsEnv: Jumpstarter's CRDs in the
// API server, the protocol-faithful test controller and router (jstest,
// TLS from a test CA) and the mirror that plays upstream's exporter and
// lease controllers on the Exporter and Lease objects (jsfake).
type jsEnv struct {
	ctl    *jstest.Controller
	mirror *jsfake.Fake
	dyn    dynamic.Interface
	client *jstest.Client // the "ci" Client, as jmp would use it
}

var jsOnce sync.Mutex

// jumpstarter starts the Jumpstarter side for tb (shared by the calls
// until tb ends).
func (e *exsEnv) jumpstarter(tb testing.TB) *jsEnv {
	tb.Helper()
	jsOnce.Lock()
	defer jsOnce.Unlock()
	if e.js != nil {
		return e.js
	}
	ctx := context.Background()
	ctl, err := jstest.Start(jstest.Options{})
	if err != nil {
		tb.Fatalf("start the test Jumpstarter controller: %v", err)
	}
	dyn, err := dynamic.NewForConfig(e.c.RESTConfig())
	if err != nil {
		tb.Fatal(err)
	}
	if err := jsv1.AddToScheme(e.cl.Scheme()); err != nil {
		tb.Fatal(err)
	}
	m := &jsfake.Fake{Client: e.cl, Ctl: ctl, Namespace: e.ns, Log: testr.NewWithInterface(tb, testr.Options{})}
	mctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); m.Run(mctx) }()
	ctl.AddClient(e.ns, "ci", "")
	e.js = &jsEnv{ctl: ctl, mirror: m, dyn: dyn, client: ctl.NewClient(e.ns, "ci")}
	// Stops after the sets are deleted (cleanups run LIFO; the env's
	// deleteAll was registered before).
	tb.Cleanup(func() {
		cancel()
		<-done
		ctl.Close()
		jsOnce.Lock()
		e.js = nil
		jsOnce.Unlock()
	})
	return e.js
}

// jsSet is a Jumpstarter-mode set of the env's test image.
// waitColdExporter waits until set (at zero) has exactly one Exporter, its
// cold one, carrying the set's exporter labels. A Lease created before it
// exists matches no Exporter and Jumpstarter ends it Unsatisfiable, as
// upstream's controller does: a lease from zero needs the cold Exporter
// first.
func (e *exsEnv) waitColdExporter(tb testing.TB, js *jsEnv, set *v1alpha1.ExporterSet) {
	tb.Helper()
	want := set.Spec.Jumpstarter.ExporterLabels
	require.Eventually(tb, func() bool {
		exps := js.exporters(tb, e.ns, set.Name)
		if len(exps) != 1 {
			return false
		}
		for _, x := range exps {
			if x.GetLabels()[v1alpha1.ExporterPodLabel] != v1alpha1.ExporterPodCold {
				return false
			}
			for k, v := range want {
				if x.GetLabels()[k] != v {
					return false
				}
			}
		}
		return true
	}, 30*time.Second, 200*time.Millisecond, "exporterset %s: one cold exporter carrying %v", set.Name, want)
}

func (e *exsEnv) jsSet(name string, replicas, minAvailable int32, js *jsEnv) *v1alpha1.ExporterSet {
	set := e.newSet(name, e.image, replicas, minAvailable)
	set.Spec.Jumpstarter = &v1alpha1.JumpstarterSpec{
		Endpoint:       js.ctl.Endpoint(),
		CABundle:       string(js.ctl.CABundle()),
		ExporterLabels: map[string]string{"board": "qemu-" + name},
	}
	return set
}

// jsSnapSet is jsSet whose pods start from a memory snapshot
// (podspec.AnnotationStartFromSnapshot in the template; the template's
// readiness probe gives the snapshot's ready point).
func (e *exsEnv) jsSnapSet(name string, replicas, minAvailable int32, js *jsEnv) *v1alpha1.ExporterSet {
	set := e.jsSet(name, replicas, minAvailable, js)
	set.Spec.Template.Annotations = map[string]string{podspec.AnnotationStartFromSnapshot: "true"}
	return set
}

// makeSnapshot has the snapshot-start set name (at replicas 0) make its
// snapshot: replicas 1 boots a VM that saves it at its first Ready (event
// SnapshotSaved) and registers its exporter; back to replicas 0, the set
// waits with no VM. Returns the SnapshotSaved message.
func (e *exsEnv) makeSnapshot(tb testing.TB, js *jsEnv, name string) string {
	tb.Helper()
	e.scaleSet(tb, name, 1, 0)
	_, pods := e.waitSet(tb, name, 2*vmBoot, "the snapshot creator Ready, its exporter Online", func(_ *v1alpha1.ExporterSet, ps []corev1.Pod) bool {
		if len(ps) != 1 || !podReady(&ps[0]) {
			return false
		}
		st, ok := js.ctl.ExporterState(e.ns, ps[0].Name)
		return ok && st.Online
	})
	creator := pods[0]
	saved := e.waitPodEvent(tb, creator.Name, snapshot.ReasonSaved, "", time.Minute)
	e.scaleSet(tb, name, 0, 0)
	e.waitVMGone(tb, creator, 2*time.Minute)
	e.waitSet(tb, name, time.Minute, "no VM", func(_ *v1alpha1.ExporterSet, ps []corev1.Pod) bool { return len(ps) == 0 })
	return saved
}

// scaleSet patches the set's replicas and minAvailable.
func (e *exsEnv) scaleSet(tb testing.TB, name string, replicas, minAvailable int32) {
	tb.Helper()
	err := e.cl.Patch(context.Background(), &v1alpha1.ExporterSet{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns}},
		client.RawPatch("application/merge-patch+json", fmt.Appendf(nil, `{"spec":{"replicas":%d,"minAvailable":%d}}`, replicas, minAvailable)))
	if err != nil {
		tb.Fatalf("scale exporterset %s to replicas %d, minAvailable %d: %v", name, replicas, minAvailable, err)
	}
}

// podEvents are the events about the pod named name, as "Reason: message".
func (e *exsEnv) podEvents(ctx context.Context, name string) ([]string, error) {
	l, err := e.c.Client().CoreV1().Events(e.ns).List(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("involvedObject.name", name).String()})
	if err != nil {
		return nil, err
	}
	var out []string
	for _, ev := range l.Items {
		out = append(out, ev.Reason+": "+ev.Message)
	}
	return out, nil
}

// waitPodEvent waits for an event about the pod named name with reason and
// a message containing msg, and returns it as "Reason: message".
func (e *exsEnv) waitPodEvent(tb testing.TB, name, reason, msg string, timeout time.Duration) string {
	tb.Helper()
	var seen []string
	deadline := time.Now().Add(timeout)
	for {
		evs, err := e.podEvents(context.Background(), name)
		if err == nil {
			seen = evs
			for _, ev := range evs {
				if strings.HasPrefix(ev, reason+": ") && strings.Contains(ev, msg) {
					return ev
				}
			}
		}
		if time.Now().After(deadline) {
			tb.Fatalf("pod %s: no event %s %q within %s; events %q", name, reason, msg, timeout, seen)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func (js *jsEnv) createLease(tb testing.TB, ns, name string, sel map[string]string) time.Time {
	tb.Helper()
	m := map[string]any{}
	for k, v := range sel {
		m[k] = v
	}
	_, err := js.dyn.Resource(jsfake.LeaseGVR).Namespace(ns).Create(context.Background(), &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "jumpstarter.dev/v1alpha1", "kind": "Lease",
		"metadata": map[string]any{"name": name},
		"spec":     map[string]any{"clientRef": map[string]any{"name": "ci"}, "selector": map[string]any{"matchLabels": m}, "duration": "30m"},
	}}, metav1.CreateOptions{})
	require.NoError(tb, err, "create lease %s", name)
	return time.Now()
}

// waitLease waits for ok on the lease; it fails tb at once if the lease
// ends before ok (unless ok accepts an ended lease).
func (js *jsEnv) waitLease(tb testing.TB, ns, name string, timeout time.Duration, what string, ok func(*unstructured.Unstructured) bool) *unstructured.Unstructured {
	tb.Helper()
	var last *unstructured.Unstructured
	deadline := time.Now().Add(timeout)
	for {
		l, err := js.dyn.Resource(jsfake.LeaseGVR).Namespace(ns).Get(context.Background(), name, metav1.GetOptions{})
		if err == nil {
			last = l
			if ok(l) {
				return l
			}
			if leaseEnded(l) {
				tb.Fatalf("lease %s ended while waiting for %s: status %v", name, what, l.Object["status"])
			}
		}
		if time.Now().After(deadline) {
			var st any
			if last != nil {
				st = last.Object["status"]
			}
			tb.Fatalf("lease %s: waiting for %s: timeout after %s; status %v", name, what, timeout, st)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (js *jsEnv) release(tb testing.TB, ns, name string) {
	tb.Helper()
	_, err := js.dyn.Resource(jsfake.LeaseGVR).Namespace(ns).Patch(context.Background(), name, "application/merge-patch+json",
		[]byte(`{"spec":{"release":true}}`), metav1.PatchOptions{})
	require.NoError(tb, err, "release lease %s", name)
}

func leaseEnded(l *unstructured.Unstructured) bool {
	e, _, _ := unstructured.NestedBool(l.Object, "status", "ended")
	return e
}

func leaseExporter(l *unstructured.Unstructured) string {
	s, _, _ := unstructured.NestedString(l.Object, "status", "exporterRef", "name")
	return s
}

func leaseCondition(l *unstructured.Unstructured, typ string) (status, reason string) {
	cs, _, _ := unstructured.NestedSlice(l.Object, "status", "conditions")
	for _, c := range cs {
		if m, ok := c.(map[string]any); ok && m["type"] == typ {
			s, _ := m["status"].(string)
			r, _ := m["reason"].(string)
			return s, r
		}
	}
	return "", ""
}

func leaseReady(l *unstructured.Unstructured) bool {
	s, _ := leaseCondition(l, "Ready")
	return s == "True" && leaseExporter(l) != ""
}

// exporters lists the set's Exporter objects by name.
func (js *jsEnv) exporters(tb testing.TB, ns, set string) map[string]*unstructured.Unstructured {
	tb.Helper()
	l, err := js.dyn.Resource(jsfake.ExporterGVR).Namespace(ns).List(context.Background(), metav1.ListOptions{LabelSelector: v1alpha1.ExporterSetLabel + "=" + set})
	require.NoError(tb, err)
	out := map[string]*unstructured.Unstructured{}
	for i := range l.Items {
		out[l.Items[i].GetName()] = &l.Items[i]
	}
	return out
}

// testJumpstarterFromZero: a Jumpstarter-mode set with replicas 0 and
// minAvailable 0 keeps one cold Exporter and no VM; a Lease created with
// kubectl stays Pending (not Unsatisfiable), a VM boots for it, its
// exporter registers and the lease gets its exporterRef; the test client
// drives the VM through the router; release -> Replace recycles it. Then
// replicas 2 / minAvailable 1 keeps a warm exporter Online while one is
// leased, and a lease created during a scale-down keeps its VM.
func (e *exsEnv) testJumpstarterFromZero(t *testing.T) {
	js := e.jumpstarter(t)
	ctx := context.Background()
	const name = "jsp"
	set := e.jsSet(name, 0, 0, js)
	sel := set.Spec.Jumpstarter.ExporterLabels
	e.createSet(t, set)

	// 1. No VM, one cold Exporter carrying the exporter labels.
	e.waitColdExporter(t, js, set)
	pods, err := e.livePods(ctx, name)
	require.NoError(t, err)
	assert.Empty(t, pods, "replicas 0: no VM before a lease waits")

	// 2. A lease with kubectl: Pending (Offline), never ended; a VM boots.
	leaseYAML := fmt.Sprintf(`apiVersion: jumpstarter.dev/v1alpha1
kind: Lease
metadata: {name: l1, namespace: %s}
spec:
  clientRef: {name: ci}
  duration: 30m
  selector: {matchLabels: {board: %s}}
`, e.ns, sel["board"])
	leaseFile := filepath.Join(t.TempDir(), "lease.yaml")
	require.NoError(t, os.WriteFile(leaseFile, []byte(leaseYAML), 0o600))
	t0 := time.Now()
	out, err := e.c.Kubectl(ctx, "create", "-f", leaseFile)
	require.NoError(t, err, out)
	js.waitLease(t, e.ns, "l1", 20*time.Second, "Pending Offline", func(l *unstructured.Unstructured) bool {
		_, r := leaseCondition(l, "Pending")
		return r == "Offline"
	})
	l1 := js.waitLease(t, e.ns, "l1", 2*vmBoot, "Ready with an exporter", leaseReady)
	fromZero := time.Since(t0)
	exp := leaseExporter(l1)
	t.Logf("lease l1 -> exporterRef %s from zero in %s", exp, fromZero.Round(time.Millisecond))
	pod, err := e.c.Client().CoreV1().Pods(e.ns).Get(ctx, exp, metav1.GetOptions{})
	require.NoError(t, err, "the exporter is the pod's")
	assert.Empty(t, pod.Spec.SchedulingGates, "the gate is gone once the credential Secret exists")
	assert.NotEmpty(t, pod.Annotations[v1alpha1.JumpstarterSecretAnnotation])
	st, ok := js.ctl.ExporterState(e.ns, exp)
	require.True(t, ok)
	assert.True(t, st.Online, "the VM's exporter is Online")
	set2, _ := e.waitSet(t, name, 30*time.Second, "leased 1", func(s *v1alpha1.ExporterSet, _ []corev1.Pod) bool { return s.Status.LeasedReplicas == 1 })
	assert.Equal(t, int32(0), set2.Status.PendingLeases)

	// 3. The client drives the VM through the router: report, console, HTTP.
	e.driveVM(t, js, "l1")

	// 4. Release: Replace recycles the VM (disabled first), back to zero.
	js.release(t, e.ns, "l1")
	js.waitLease(t, e.ns, "l1", 30*time.Second, "ended", leaseEnded)
	e.waitVMGone(t, *pod, 2*time.Minute)
	require.Eventually(t, func() bool {
		_, still := js.exporters(t, e.ns, name)[exp]
		return !still
	}, time.Minute, 250*time.Millisecond, "the recycled VM's Exporter is deleted")

	// 5. replicas 2, minAvailable 1: a warm exporter stays Online while one
	// is leased.
	require.NoError(t, e.cl.Patch(ctx, &v1alpha1.ExporterSet{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns}},
		client.RawPatch("application/merge-patch+json", []byte(`{"spec":{"replicas":2,"minAvailable":1}}`))))
	_, pods = e.waitSet(t, name, 2*vmBoot, "2 VMs with Online exporters", func(s *v1alpha1.ExporterSet, ps []corev1.Pod) bool {
		if len(ps) != 2 {
			return false
		}
		for _, p := range ps {
			if st, ok := js.ctl.ExporterState(e.ns, p.Name); !ok || !st.Online || !podReady(&p) {
				return false
			}
		}
		return true
	})
	t1 := js.createLease(t, e.ns, "l2", sel)
	l2 := js.waitLease(t, e.ns, "l2", time.Minute, "Ready", leaseReady)
	warm := time.Since(t1)
	t.Logf("lease l2 -> exporterRef on a warm set in %s (from zero: %s)", warm.Round(time.Millisecond), fromZero.Round(time.Millisecond))
	leased2 := leaseExporter(l2)
	_, pods = e.waitSet(t, name, 30*time.Second, "one leased, one warm", func(s *v1alpha1.ExporterSet, ps []corev1.Pod) bool {
		return s.Status.LeasedReplicas == 1 && s.Status.AvailableReplicas >= 1 && len(ps) == 2
	})
	for _, p := range pods {
		st, _ := js.ctl.ExporterState(e.ns, p.Name)
		assert.True(t, st.Online, "pod %s: exporter Online", p.Name)
		if p.Name != leased2 {
			assert.Empty(t, st.Lease, "the warm one is unleased")
		}
	}

	// 6. A lease created as the set scales down keeps its VM: the set
	// counts it as demand, and whichever VM it lands on survives.
	js.createLease(t, e.ns, "l3", sel)
	require.NoError(t, e.cl.Patch(ctx, &v1alpha1.ExporterSet{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: e.ns}},
		client.RawPatch("application/merge-patch+json", []byte(`{"spec":{"replicas":0,"minAvailable":0}}`))))
	l3 := js.waitLease(t, e.ns, "l3", 2*vmBoot, "Ready", leaseReady)
	leased3 := leaseExporter(l3)
	assert.NotEqual(t, leased2, leased3)
	// Both leased VMs stay while their leases run.
	time.Sleep(5 * time.Second)
	pods, err = e.livePods(ctx, name)
	require.NoError(t, err)
	assert.ElementsMatch(t, []string{leased2, leased3}, podNames(pods), "leased VMs are never scaled down")

	// 7. Both released: back to zero VMs and the cold exporter.
	js.release(t, e.ns, "l2")
	js.release(t, e.ns, "l3")
	for _, p := range pods {
		e.waitVMGone(t, p, 2*time.Minute)
	}
	require.Eventually(t, func() bool {
		exps := js.exporters(t, e.ns, name)
		if len(exps) != 1 {
			return false
		}
		for _, x := range exps {
			return x.GetLabels()[v1alpha1.ExporterPodLabel] == v1alpha1.ExporterPodCold
		}
		return false
	}, time.Minute, 250*time.Millisecond, "back to the cold exporter alone")
}

// testJumpstarterSnapshot: a Jumpstarter-mode set whose template asks for
// snapshot start. Its first VM boots, saves the snapshot at its first Ready
// and registers its exporter; at replicas 0 a Lease then makes the set
// start a VM that is restored from the snapshot (not booted), whose exporter
// registers (the exporter's Secret volume and annotation are per pod, on
// the host, and do not stop the restore) and serves the lease: the driver
// tree, the console both ways and the guest's HTTP port, through the
// router. Release recycles it.
func (e *exsEnv) testJumpstarterSnapshot(t *testing.T) {
	js := e.jumpstarter(t)
	const name = "jss"
	set := e.jsSnapSet(name, 0, 0, js)
	e.createSet(t, set)
	saved := e.makeSnapshot(t, js, name)
	t.Logf("creator: %s", saved)

	t0 := js.createLease(t, e.ns, "s1", set.Spec.Jumpstarter.ExporterLabels)
	l := js.waitLease(t, e.ns, "s1", 2*vmBoot, "Ready with an exporter", leaseReady)
	ref := time.Since(t0)
	exp := leaseExporter(l)
	started := e.waitPodEvent(t, exp, "Started", "restored from a memory snapshot", 30*time.Second)
	t.Logf("lease s1 -> exporterRef %s from zero with snapshot start in %s (%s)", exp, ref.Round(time.Millisecond), started)
	evs, err := e.podEvents(context.Background(), exp)
	require.NoError(t, err)
	for _, ev := range evs {
		assert.NotContains(t, ev, snapshot.ReasonRestoreFailed, "pod %s", exp)
		assert.NotContains(t, ev, snapshot.ReasonSkipped, "pod %s", exp)
		assert.NotContains(t, ev, snapshot.ReasonSaved, "pod %s: a restored VM saves no snapshot", exp)
	}
	st, ok := js.ctl.ExporterState(e.ns, exp)
	require.True(t, ok, "the restored VM's exporter registered")
	assert.True(t, st.Online)
	assert.Equal(t, "s1", st.Lease)

	e.driveVM(t, js, "s1")

	pod, err := e.c.Client().CoreV1().Pods(e.ns).Get(context.Background(), exp, metav1.GetOptions{})
	require.NoError(t, err)
	js.release(t, e.ns, "s1")
	js.waitLease(t, e.ns, "s1", 30*time.Second, "ended", leaseEnded)
	e.waitVMGone(t, *pod, 2*time.Minute)
}

// checkGuestLogin: get_username and get_password answer the login of the
// pod's exporter Secret, by default one the controller generated for the
// pod (none for a snapshot-start pod), and the guest got it in its
// NoCloud seed (the test image prints the md5 of each file of its config
// disks on the console).
func (e *exsEnv) checkGuestLogin(ctx context.Context, t *testing.T, sess *jstest.Session, rep *pb.GetReportResponse) {
	t.Helper()
	root, ok := jstest.FindDriver(rep, "")
	require.True(t, ok, "the root driver")
	call := func(m string) string {
		v, err := sess.Call(ctx, root.Uuid, m)
		require.NoError(t, err, m)
		s, _ := v.(string)
		return s
	}
	host, user, pass := call("get_hostname"), call("get_username"), call("get_password")
	pod, err := e.c.Client().CoreV1().Pods(e.ns).Get(ctx, host, metav1.GetOptions{})
	require.NoError(t, err, "get_hostname is the pod's name")
	sec, err := e.c.Client().CoreV1().Secrets(e.ns).Get(ctx, pod.Annotations[v1alpha1.JumpstarterSecretAnnotation], metav1.GetOptions{})
	require.NoError(t, err, "the pod's exporter Secret")
	assert.Equal(t, string(sec.Data[v1alpha1.JumpstarterSecretUsername]), user, "get_username is the Secret's")
	assert.Equal(t, string(sec.Data[v1alpha1.JumpstarterSecretPassword]), pass, "get_password is the Secret's")
	if pod.Annotations[podspec.AnnotationStartFromSnapshot] == "true" {
		assert.Empty(t, user, "a snapshot-start pod gets no default login")
		return
	}
	assert.Equal(t, v1alpha1.GeneratedGuestLoginUser, user, "the default login")
	assert.Len(t, pass, 32, "a generated password")
	// The guest's seed holds the login: the test image prints it while it
	// boots (a pod without a readiness probe may be leased before).
	want := fmt.Sprintf("QK-CONFIG cloud-init vendor-data %x", md5sum(podspec.GuestLogin{Username: user, Password: pass}.VendorData()))
	waitFileContains(t, filepath.Join(e.stateDir, "vms", string(pod.UID), qemu.ConsoleLogName), want, vmBoot)
}

// typeUntilEcho types line on w every 2 s until each of rs shows the test
// image's echo of it ("QK-ECHO: <line>"), within d (a line typed while the
// guest's reader is not there yet is lost, as on a real serial line).
func typeUntilEcho(t *testing.T, w io.Writer, rs []io.Reader, line string, d time.Duration) {
	t.Helper()
	found := make(chan bool, len(rs))
	for _, r := range rs {
		go func(r io.Reader) {
			sc := bufio.NewScanner(r)
			for sc.Scan() {
				if strings.Contains(sc.Text(), "QK-ECHO: "+line) {
					found <- true
					return
				}
			}
			found <- false
		}(r)
	}
	deadline := time.After(d)
	tick := time.NewTicker(2 * time.Second)
	defer tick.Stop()
	_, err := io.WriteString(w, line+"\n")
	require.NoError(t, err)
	for seen := 0; seen < len(rs); {
		select {
		case ok := <-found:
			if !assert.True(t, ok, "console echoes %s (the stream ended first)", line) {
				return
			}
			seen++
		case <-tick.C:
			_, err = io.WriteString(w, line+"\n")
			require.NoError(t, err, "type %s", line)
		case <-deadline:
			t.Errorf("console: %d of %d sessions saw the echo of %s within %s", seen, len(rs), line, d)
			return
		}
	}
}

// driveVM dials the lease through the router as jmp does and drives the
// VM: the driver tree, the serial console both ways, the guest's HTTP port.
func (e *exsEnv) driveVM(t *testing.T, js *jsEnv, lease string) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	sess, err := js.client.Dial(ctx, lease)
	require.NoError(t, err, "dial lease %s", lease)
	defer sess.Close()
	rep, err := sess.GetReport(ctx)
	require.NoError(t, err)
	for name, class := range map[string]string{
		"power":   "jumpstarter_driver_power.client.PowerClient",
		"console": "jumpstarter_driver_pyserial.client.PySerialClient",
		"http":    "jumpstarter_driver_network.client.NetworkClient",
	} {
		d, ok := jstest.FindDriver(rep, name)
		if assert.True(t, ok, "driver %s in the report", name) {
			assert.Equal(t, class, d.Labels["jumpstarter.dev/client"], "driver %s", name)
		}
	}

	e.checkGuestLogin(ctx, t, sess, rep)

	// Console: type a line, the test image echoes it as "QK-ECHO: <line>".
	con, _ := jstest.FindDriver(rep, "console")
	cs, err := sess.Stream(ctx, con.Uuid, "connect")
	require.NoError(t, err)
	defer cs.Close()
	marker := fmt.Sprintf("qk-js-%d", time.Now().UnixNano())
	typeUntilEcho(t, cs, []io.Reader{cs}, marker, 60*time.Second)
	// A second session types while the first is open: the lease's sessions
	// type together, as on upstream's pty console, and each sees the
	// guest's output.
	cs2, err := sess.Stream(ctx, con.Uuid, "connect")
	require.NoError(t, err)
	defer cs2.Close()
	typeUntilEcho(t, cs2, []io.Reader{cs, cs2}, marker+"-second", 45*time.Second)

	// TCP to the guest's HTTP port (the template's port named http).
	hd, _ := jstest.FindDriver(rep, "http")
	hs, err := sess.Stream(ctx, hd.Uuid, "connect")
	require.NoError(t, err)
	defer hs.Close()
	_, err = io.WriteString(hs, "GET / HTTP/1.0\r\nHost: guest\r\n\r\n")
	require.NoError(t, err)
	resp, err := http.ReadResponse(bufio.NewReader(hs), nil)
	require.NoError(t, err, "HTTP through the router to the guest")
	body, _ := io.ReadAll(resp.Body)
	assert.Equal(t, 200, resp.StatusCode)
	assert.Contains(t, string(body), "QK-HTTP-OK", "the guest's page")
}
