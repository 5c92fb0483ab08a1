package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	vtv1 "github.com/qemu-kubelet/qemu-kubelet/api/virtualtarget/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/controller"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// upstreamRole is the Role Jumpstarter's operator binds a provisioner's
// ServiceAccount to, rule for rule.
func upstreamRole(ns, name string) *rbacv1.Role {
	all := []string{"get", "list", "watch", "create", "update", "patch", "delete"}
	read := []string{"get", "list", "watch"}
	return &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Rules: []rbacv1.PolicyRule{
		{APIGroups: []string{vtv1.GroupVersion.Group}, Resources: []string{"exportersets"}, Verbs: read},
		{APIGroups: []string{vtv1.GroupVersion.Group}, Resources: []string{"exportersets/status", "exportersets/scale"}, Verbs: []string{"get", "update", "patch"}},
		{APIGroups: []string{vtv1.GroupVersion.Group}, Resources: []string{"exportersets/finalizers"}, Verbs: []string{"update"}},
		{APIGroups: []string{vtv1.GroupVersion.Group}, Resources: []string{"virtualtargetclasses"}, Verbs: read},
		{APIGroups: []string{"jumpstarter.dev"}, Resources: []string{"exporters"}, Verbs: all},
		{APIGroups: []string{"jumpstarter.dev"}, Resources: []string{"leases"}, Verbs: read},
		{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: all},
		{APIGroups: []string{""}, Resources: []string{"events"}, Verbs: []string{"create", "patch"}},
		{APIGroups: []string{""}, Resources: []string{"secrets"}, Verbs: []string{"get", "list", "watch", "create", "update", "patch"}},
		{APIGroups: []string{""}, Resources: []string{"configmaps"}, Verbs: read},
		{APIGroups: []string{"coordination.k8s.io"}, Resources: []string{"leases"}, Verbs: all},
	}}
}

// startProvisioner runs the exporterset-controller as Jumpstarter's
// operator runs a provisioner: upstream's flags, NAMESPACE, and a
// ServiceAccount identity bound to upstream's Role alone. It returns the
// log's path and the health address.
func (e *exsEnv) startProvisioner(t testing.TB) (string, string) {
	t.Helper()
	ctx := context.Background()
	const sa = "exs-provisioner"
	cs := e.c.Client()
	_, err := cs.CoreV1().ServiceAccounts(e.ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = cs.RbacV1().Roles(e.ns).Create(ctx, upstreamRole(e.ns, sa), metav1.CreateOptions{})
	require.NoError(t, err)
	_, err = cs.RbacV1().RoleBindings(e.ns).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: sa},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: sa},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Namespace: e.ns, Name: sa}}}, metav1.CreateOptions{})
	require.NoError(t, err)
	// The ServiceAccount's user name and groups, as its token would
	// authenticate (a client certificate here: RBAC matches the names).
	kc, err := e.c.UserKubeconfig("system:serviceaccount:"+e.ns+":"+sa, "system:serviceaccounts", "system:serviceaccounts:"+e.ns)
	require.NoError(t, err)

	tmp := t.TempDir()
	bin := goBuild(t, ocitest.RepoRoot(t), tmp, "./cmd/exporterset-controller")
	health := fmt.Sprintf("127.0.0.1:%d", testutil.FreePort(t))
	logPath := filepath.Join(tmp, "exporter-set-controller.log")
	t.Setenv("NAMESPACE", e.ns) // the child inherits it
	startProcess(t, "exporter-set-controller", logPath, bin, "--provisioner="+vtv1.DefaultProvisioner, "--leader-elect",
		"--health-probe-bind-address="+health, "--metrics-bind-address=0", "--kubeconfig="+kc, "-v", "2")
	return logPath, health
}

// installUpstreamCRDs installs upstream's virtualtarget.jumpstarter.dev
// CRDs (the project's copies) and waits until they are served.
func (e *exsEnv) installUpstreamCRDs(t testing.TB) {
	t.Helper()
	ctx := context.Background()
	out, err := e.c.Kubectl(ctx, "apply", "--server-side", "-f", filepath.Join(ocitest.RepoRoot(t), "config", "virtualtarget", "crd"))
	require.NoError(t, err, out)
	require.NoError(t, vtv1.AddToScheme(e.cl.Scheme()))
	require.NoError(t, wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		return e.cl.List(ctx, &vtv1.ExporterSetList{}, client.InNamespace(e.ns)) == nil &&
			e.cl.List(ctx, &vtv1.VirtualTargetClassList{}, client.InNamespace(e.ns)) == nil, nil
	}), "virtualtarget CRDs never served")
}

// TestUpstreamExporterSet: an ExporterSet of upstream Jumpstarter's own
// API (virtualtarget.jumpstarter.dev) whose class names provisioner
// qemu-kubelet.io and no image, served by the exporterset-controller
// started as Jumpstarter's operator starts a provisioner (upstream's
// flags, NAMESPACE, a ServiceAccount bound to upstream's Role alone). At
// minReplicas 0 it keeps a cold Exporter and no VM; a Lease created then
// gets a VM from zero through the Jumpstarter double: the pod's Exporter
// and its exporter-config-<exporter> Secret are made, the VM boots its
// empty disk on the qemu-kubelet node, its exporter registers and the
// lease is served; the lease flashes a bootable raw disk onto root and the
// VM boots it through the firmware (no -kernel), answering on its console
// and the guest HTTP port named by the template's Qemu driver hostfwd.
// Then: ExitAndReplace retires the used VM and its Secret, a fresh one
// replaces it; InPlaceReuse keeps the released VM (same UID, through
// AFTER_LEASE_HOOK, reset to its empty disk, Available again, no VM
// added); a scale-down to minReplicas 0 with one VM leased disables the
// idle VM's Exporter before deleting it and never disables the leased one
// while it is held. A set of class qemu.jumpstarter.dev in the same
// namespace is never touched (no status, no pod, no event) and the
// controller's log shows no Forbidden.
func TestUpstreamExporterSet(t *testing.T) {
	e := startExsEnv(t)
	js := e.jumpstarter(t)
	u := e.startUpstream(t, js)
	ctx := context.Background()
	sel := map[string]string{"board": "qemu-up"}

	// 1. At zero: the cold Exporter (the template's labels), no VM.
	require.Eventually(t, func() bool {
		var x jsv1.Exporter
		err := e.cl.Get(ctx, types.NamespacedName{Namespace: e.ns, Name: "up-cold"}, &x)
		return err == nil && x.Labels["board"] == "qemu-up" && x.Labels[controller.UpstreamExporterSetLabel] == "up"
	}, 30*time.Second, 200*time.Millisecond, "the set's cold exporter")
	assert.Empty(t, e.upstreamPods(t, "up"), "minReplicas 0: no VM before a lease waits")

	// 2. A lease from zero: a VM of an empty disk boots, its exporter
	// registers, the lease is served; the lease flashes root and the VM
	// boots it.
	t0 := js.createLease(t, e.ns, "u1", sel)
	l1 := js.waitLease(t, e.ns, "u1", 2*vmBoot, "Ready with an exporter", leaseReady)
	t.Logf("lease u1 -> exporterRef %s from zero through the upstream API in %s", leaseExporter(l1), time.Since(t0).Round(time.Millisecond))
	exp := leaseExporter(l1)
	pod, err := e.c.Client().CoreV1().Pods(e.ns).Get(ctx, exp, metav1.GetOptions{})
	require.NoError(t, err, "the exporter is the pod's")
	assert.Equal(t, "up", pod.Labels[controller.UpstreamExporterSetLabel])
	assert.Empty(t, pod.Spec.SchedulingGates, "the gate is gone once the credential Secret exists")
	assert.Equal(t, "exporter-config-"+exp, pod.Annotations[v1alpha1.JumpstarterSecretAnnotation])
	sec, err := e.c.Client().CoreV1().Secrets(e.ns).Get(ctx, "exporter-config-"+exp, metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, "up", sec.Labels[controller.UpstreamExporterSetLabel])
	c := pod.Spec.Containers[0]
	assert.Equal(t, "256Mi", ptr.To(c.Resources.Limits[corev1.ResourceMemory]).String(), "the Qemu driver's mem")
	assert.Equal(t, v1alpha1.EmptyDiskImage, c.Image, "no image parameter: an empty disk")
	assert.Equal(t, "128Mi", ptr.To(c.Resources.Limits[corev1.ResourceEphemeralStorage]).String(), "resources.storage sizes it")
	st, ok := js.ctl.ExporterState(e.ns, exp)
	require.True(t, ok)
	assert.True(t, st.Online, "the VM's exporter is Online")
	e.waitImageID(t, exp, v1alpha1.EmptyDiskImage+"@sha256:", time.Minute)
	assert.Empty(t, e.vmSpec(t, *pod).Kernel, "the empty disk boots through the firmware")

	t1 := time.Now()
	digest := e.flashRoot(t, js, "u1", u.rawDisk)
	e.waitImageID(t, exp, "flash/root@"+digest, 2*time.Minute)
	waitFileContains(t, filepath.Join(e.stateDir, "vms", string(pod.UID), qemu.ConsoleLogName), vmtest.BootMarker, vmBoot)
	t.Logf("root flashed (%s) and booted through the firmware in %s", digest, time.Since(t1).Round(time.Millisecond))
	flashed := e.vmSpec(t, *pod)
	assert.Empty(t, flashed.Kernel, "the flashed disk boots through the firmware, no -kernel")
	require.NotEmpty(t, flashed.Disks)
	e.driveVM(t, js, "u1")
	e.waitUpstream(t, "up", time.Minute, "leased 1, exporter active", func(s vtv1.ExporterSetStatus) bool {
		return s.LeasedReplicas == 1 && s.ExportersActive == 1
	})

	for _, step := range []struct {
		name string
		run  func()
	}{
		{"ExitAndReplace", func() { e.upstreamExitAndReplace(t, js, *pod) }},
		{"InPlaceReuse", func() { e.upstreamInPlaceReuse(t, js, u.rawDisk) }},
		{"scale-down to 0 with one VM leased", func() { e.upstreamScaleDown(t, js) }},
	} {
		t1 := time.Now()
		step.run()
		t.Logf("%s: done in %s", step.name, time.Since(t1).Round(time.Millisecond))
	}

	// The other provisioner's set: never written, no pod, no event.
	require.NoError(t, e.cl.Get(ctx, client.ObjectKeyFromObject(u.other), u.other))
	assert.Equal(t, u.otherRV, u.other.ResourceVersion, "qemu.jumpstarter.dev's set is never written")
	assert.Empty(t, u.other.Status.Conditions)
	assert.Empty(t, e.upstreamPods(t, "other"))
	evs, err := e.c.Client().CoreV1().Events(e.ns).List(ctx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("involvedObject.name", "other").String()})
	require.NoError(t, err)
	assert.Empty(t, evs.Items, "no event about the other provisioner's set")
	evs, err = e.c.Client().CoreV1().Events(e.ns).List(ctx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("involvedObject.name", "up").String()})
	require.NoError(t, err)
	assert.NotEmpty(t, evs.Items, "the set's events are written (core events: the Role's)")

	// Upstream's Role was enough.
	b, err := os.ReadFile(u.logPath)
	require.NoError(t, err)
	for _, line := range strings.Split(string(b), "\n") {
		assert.NotContains(t, strings.ToLower(line), "forbidden", "the provisioner under upstream's Role")
	}
}

// upstreamPods are the live pods of the upstream set name.
func (e *exsEnv) upstreamPods(t testing.TB, name string) []corev1.Pod {
	t.Helper()
	l, err := e.c.Client().CoreV1().Pods(e.ns).List(context.Background(), metav1.ListOptions{LabelSelector: controller.UpstreamLabel + "=" + name})
	require.NoError(t, err)
	var out []corev1.Pod
	for _, p := range l.Items {
		if p.DeletionTimestamp == nil {
			out = append(out, p)
		}
	}
	return out
}

// waitUpstream waits until the upstream set's status satisfies ok.
func (e *exsEnv) waitUpstream(t *testing.T, name string, timeout time.Duration, what string, ok func(vtv1.ExporterSetStatus) bool) {
	t.Helper()
	var s vtv1.ExporterSet
	deadline := time.Now().Add(timeout)
	for e.cl.Get(context.Background(), types.NamespacedName{Namespace: e.ns, Name: name}, &s) != nil || !ok(s.Status) {
		if time.Now().After(deadline) {
			t.Fatalf("exporterset %s: %s: timeout after %s; status %+v", name, what, timeout, s.Status)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

// deleteUpstreamSet deletes the upstream set and waits until its VMs
// stopped.
func (e *exsEnv) deleteUpstreamSet(t testing.TB, name string) {
	ps := e.upstreamPods(t, name)
	err := e.cl.Delete(context.Background(), &vtv1.ExporterSet{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: name}},
		client.PropagationPolicy(metav1.DeletePropagationForeground))
	if err != nil && !apierrors.IsNotFound(err) {
		t.Errorf("delete exporterset %s: %v", name, err)
	}
	for _, p := range ps {
		e.waitVMGone(t, p, 90*time.Second)
	}
}
