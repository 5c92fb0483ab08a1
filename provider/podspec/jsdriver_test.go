package podspec

import (
	"context"
	"strings"
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"
)

// Tests of what the node adds to upstream's QEMU driver calls (issue 27):
// resize checks, the guest login's seed, the display annotation.

// loginSecretKV are the exporter Secret's connection keys.
var loginSecretKV = []string{"endpoint", "grpc.js.example:443", "token", "s3cr3t-token", "namespace", "jumpstarter-lab", "name", "board-0"}

func loginSecret(kv ...string) *corev1.Secret {
	s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "lab", Name: "js"}, Data: map[string][]byte{}}
	for i := 0; i+1 < len(kv); i += 2 {
		s.Data[kv[i]] = []byte(kv[i+1])
	}
	return s
}

func loginPod() *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "lab", Name: "board-0", Annotations: map[string]string{"qemu-kubelet.io/jumpstarter-exporter-secret": "js"}},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "vm", Image: "r/os:1"}}},
	}
}

func memPod(uid string, req, lim string) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: uid, UID: types.UID(uid)},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "vm"}}}}
	if req != "" {
		p.Spec.Containers[0].Resources.Requests = corev1.ResourceList{corev1.ResourceMemory: resource.MustParse(req)}
	}
	if lim != "" {
		p.Spec.Containers[0].Resources.Limits = corev1.ResourceList{corev1.ResourceMemory: resource.MustParse(lim)}
	}
	return p
}
func TestCheckMemorySize(t *testing.T) {
	node := NodeCapacity{Allocatable: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("4Gi")}, VMOverhead: resource.MustParse("128Mi")}
	others := []*corev1.Pod{memPod("a", "1Gi", ""), memPod("b", "1Gi", "")}
	self := memPod("me", "512Mi", "")
	// 4Gi - 2*(1Gi+128Mi) = 1792Mi free for this VM's memory + overhead.
	for _, c := range []struct {
		name  string
		pod   *corev1.Pod
		bytes int64
		want  string // "" = accepted
	}{
		{"grow within the node", self, 1 << 30, ""},
		{"exactly what is left", self, 1664 << 20, ""},
		{"one MiB over the node", self, 1665 << 20, "the node cannot give it: allocatable 4Gi, claimed by the other VMs 2304Mi, this VM would claim 1793Mi"},
		{"shrink below the request is fine", self, 256 << 20, ""},
		{"below QEMU's minimum", self, 16 << 20, "below the 32 MiB a VM needs"},
		{"over the pod's limit", memPod("me", "256Mi", "1Gi"), 2 << 30, "over the pod's memory limit 1Gi"},
		{"at the pod's limit", memPod("me", "256Mi", "1Gi"), 1 << 30, ""},
		{"absurd", self, 1 << 60, "above the 16Ti a VM may have"},
	} {
		err := CheckMemorySize(c.pod, c.bytes, node, append(others, c.pod))
		if c.want == "" {
			assert.NoError(t, err, c.name)
			continue
		}
		require.Error(t, err, c.name)
		assert.ErrorContains(t, err, c.want, c.name)
	}
	// Admission counts a resized VM's larger memory.
	grown := WithMemoryClaim(self, 3<<30)
	assert.Equal(t, "3Gi", grown.Spec.Containers[0].Resources.Requests.Memory().String())
	assert.Equal(t, "512Mi", self.Spec.Containers[0].Resources.Requests.Memory().String(), "the pod itself is not changed")
	assert.Same(t, self, WithMemoryClaim(self, 256<<20), "a smaller size claims the request")
	rej := Admit(memPod("new", "1Gi", ""), Plan{}, node, []*corev1.Pod{grown})
	require.NotNil(t, rej, "3Gi+128Mi claimed: a 1Gi pod no longer fits")
	assert.Equal(t, "OutOfmemory", rej.Reason)
}
func TestCheckDiskSize(t *testing.T) {
	pod := memPod("me", "", "")
	ok := DiskFacts{HasDisk: true, CurrentBytes: 2 << 30, FreeBytes: 100 << 30}
	limited := memPod("me", "", "")
	limited.Spec.Containers[0].Resources.Limits = corev1.ResourceList{corev1.ResourceEphemeralStorage: resource.MustParse("10Gi")}
	for _, c := range []struct {
		name  string
		pod   *corev1.Pod
		bytes int64
		f     DiskFacts
		want  string
	}{
		{"grow", pod, 20 << 30, ok, ""},
		{"same size", pod, 2 << 30, ok, ""},
		{"shrink", pod, 1 << 30, ok, "Shrinking disk is not supported: current 2Gi"},
		{"no disk", pod, 20 << 30, DiskFacts{FreeBytes: 100 << 30}, "the VM has no disk"},
		{"snapshot start", pod, 20 << 30, DiskFacts{HasDisk: true, SnapshotStart: true, FreeBytes: 100 << 30}, "memory snapshots"},
		{"over the node's free space", pod, 200 << 30, ok, "Not enough disk space: the node has 100Gi free"},
		{"over the pod's limit", limited, 20 << 30, ok, "over the pod's ephemeral-storage limit 10Gi"},
	} {
		err := CheckDiskSize(c.pod, c.bytes, c.f)
		if c.want == "" {
			assert.NoError(t, err, c.name)
			continue
		}
		require.Error(t, err, c.name)
		assert.ErrorContains(t, err, c.want, c.name)
	}
}
func TestGuestLoginFromSecret(t *testing.T) {
	const pw = "pa55:word with spaces"
	l, err := GuestLoginFromSecret(loginSecret("username", "jumpstarter", "password", pw+"\n"), "secret js")
	require.NoError(t, err)
	assert.Equal(t, &GuestLogin{Username: "jumpstarter", Password: pw}, l, "a trailing new line (from a file) is dropped")
	assert.NotContains(t, l.String()+" "+l.GoString(), pw)
	l, err = GuestLoginFromSecret(loginSecret(loginSecretKV...), "secret js")
	require.NoError(t, err)
	assert.Nil(t, l, "no login keys: no login")
	for name, kv := range map[string][]string{
		"user only":        {"username", "ci"},
		"password only":    {"password", pw},
		"bad user":         {"username", "Bad User", "password", pw},
		"root":             {"username", "root", "password", pw},
		"control char":     {"username", "ci", "password", "a\tb"},
		"newline inside":   {"username", "ci", "password", "a\nb"},
		"password too big": {"username", "ci", "password", strings.Repeat("x", MaxGuestPasswordBytes+1)},
	} {
		_, err := GuestLoginFromSecret(loginSecret(kv...), "secret js")
		require.Error(t, err, name)
		assert.True(t, IsConfigError(err), "%s: a ConfigError (the pod waits): %v", name, err)
		assert.NotContains(t, err.Error(), pw, name)
		assert.NotContains(t, err.Error(), "a\tb", name)
	}
}

// TestGuestLoginVendorData: the vendor-data is a #cloud-config with the
// user, its password (quoted whatever it holds) and ssh password login.
func TestGuestLoginVendorData(t *testing.T) {
	l := GuestLogin{Username: "jumpstarter", Password: `p: "x" #not-a-comment`}
	vd := l.VendorData()
	require.True(t, strings.HasPrefix(string(vd), "#cloud-config\n"), "%s", vd)
	var doc struct {
		Users    []any `json:"users"`
		Chpasswd struct {
			Expire bool `json:"expire"`
			Users  []struct{ Name, Password, Type string }
		} `json:"chpasswd"`
		SSHPwauth bool `json:"ssh_pwauth"`
	}
	require.NoError(t, yaml.Unmarshal(vd, &doc), "%s", vd)
	assert.True(t, doc.SSHPwauth)
	assert.False(t, doc.Chpasswd.Expire)
	require.Len(t, doc.Chpasswd.Users, 1)
	assert.Equal(t, "jumpstarter", doc.Chpasswd.Users[0].Name)
	assert.Equal(t, l.Password, doc.Chpasswd.Users[0].Password)
	assert.Equal(t, "text", doc.Chpasswd.Users[0].Type)
	require.Len(t, doc.Users, 2)
	assert.Equal(t, "default", doc.Users[0])
	u := doc.Users[1].(map[string]any)
	assert.Equal(t, "jumpstarter", u["name"])
	assert.Equal(t, l.Password, u["plain_text_passwd"])
	assert.Equal(t, false, u["lock_passwd"])
	assert.Equal(t, "ALL=(ALL) NOPASSWD:ALL", u["sudo"])
}

// TestPlanGuestDisksLogin: an exporter pod whose Secret names a login gets
// it as vendor-data of its NoCloud seed, made for it when it has no
// cloud-init volume; its own user-data and meta-data stay as they are; a
// cloud-init volume with its own vendor-data is a ConfigError; a pod
// without a login gets no seed.
func TestPlanGuestDisksLogin(t *testing.T) {
	const pw = "Very-secret-1"
	secret := loginSecret(append(append([]string{}, loginSecretKV...), "username", "ci", "password", pw)...)
	ci := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "lab", Name: "ci"},
		Data: map[string]string{"user-data": "#cloud-config\nruncmd: [echo hi]\n", "meta-data": "instance-id: mine\n"}}
	ciVendor := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "lab", Name: "ci-vendor"},
		Data: map[string]string{"user-data": "#cloud-config\n", "vendor-data": "#cloud-config\n"}}
	src := ConfigSources{
		Secret: func(_ context.Context, ns, name string) (*corev1.Secret, error) {
			if name == "js" {
				return secret, nil
			}
			return nil, errNotFound("secrets", name)
		},
		ConfigMap: func(_ context.Context, ns, name string) (*corev1.ConfigMap, error) {
			switch name {
			case "ci":
				return ci, nil
			case "ci-vendor":
				return ciVendor, nil
			}
			return nil, errNotFound("configmaps", name)
		},
	}
	pod := loginPod()
	pod.UID = "u-1"
	pod.Spec.Volumes = []corev1.Volume{{Name: "jumpstarter", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{SecretName: "js"}}}}

	disks, err := planGuestDisks(context.Background(), pod, src)
	require.NoError(t, err)
	require.Len(t, disks, 1, "only the seed: the exporter Secret's volume stays on the host")
	seed := disks[0]
	assert.Equal(t, CloudInitLabel, seed.Label)
	assert.Equal(t, "instance-id: u-1\nlocal-hostname: board-0\n", string(seed.Files["meta-data"]))
	assert.Empty(t, seed.Files["user-data"])
	assert.Contains(t, string(seed.Files["vendor-data"]), pw)
	assert.Len(t, seed.Files, 3)

	withCI := pod.DeepCopy()
	withCI.Spec.Volumes = append(withCI.Spec.Volumes, corev1.Volume{Name: CloudInitVolumeName, VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{LocalObjectReference: corev1.LocalObjectReference{Name: "ci"}}}})
	disks, err = planGuestDisks(context.Background(), withCI, src)
	require.NoError(t, err)
	require.Len(t, disks, 1)
	assert.Equal(t, ci.Data["user-data"], string(disks[0].Files["user-data"]), "the pod's user-data is left alone")
	assert.Equal(t, ci.Data["meta-data"], string(disks[0].Files["meta-data"]))
	assert.Contains(t, string(disks[0].Files["vendor-data"]), pw)

	own := pod.DeepCopy()
	own.Spec.Volumes = append(own.Spec.Volumes, corev1.Volume{Name: CloudInitVolumeName, VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{LocalObjectReference: corev1.LocalObjectReference{Name: "ci-vendor"}}}})
	_, err = planGuestDisks(context.Background(), own, src)
	require.Error(t, err)
	assert.True(t, IsConfigError(err))
	assert.ErrorContains(t, err, "holds vendor-data")
	assert.ErrorContains(t, err, "spec.jumpstarter.defaultGuestLogin None", "how a set's pod does without its login")
	assert.NotContains(t, err.Error(), pw)

	secret = loginSecret(loginSecretKV...) // no login
	disks, err = planGuestDisks(context.Background(), pod, src)
	require.NoError(t, err)
	assert.Empty(t, disks, "no login, no seed")
}

// TestDisplayDefault: an exporter pod's VM has a display (and its
// exporter the vnc child) unless the annotation says none, as upstream's
// QEMU driver always has vnc; any other pod has none unless it asks. Where
// the display cannot apply (machine microvm) the default is off, never a
// refused pod; asked for there, the pod is refused. DisplayOf (the
// exporter's view) and Translate's Plan.Display (the VM's) agree on every
// row.
func TestDisplayDefault(t *testing.T) {
	exporter := func(p *corev1.Pod) { p.Annotations[v1alpha1.JumpstarterSecretAnnotation] = "js" }
	ann := func(k, v string) func(*corev1.Pod) { return func(p *corev1.Pod) { p.Annotations[k] = v } }
	emptyDisk := func(p *corev1.Pod) {
		p.Spec.Containers[0].Image = v1alpha1.EmptyDiskImage
		p.Spec.Containers[0].Resources.Limits = podtest.RL("ephemeral-storage", "1Gi")
	}
	snapshotStart := func(p *corev1.Pod) {
		p.Annotations[AnnotationStartFromSnapshot] = "true"
		p.Spec.Containers[0].ReadinessProbe = &corev1.Probe{ProbeHandler: corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(80)}}}
	}
	for _, tc := range []struct {
		name   string
		arch   qemu.Arch
		mut    []func(*corev1.Pod)
		want   bool
		refuse string // a rejection containing this ("": valid)
	}{
		{name: "exporter pod: on by default", mut: []func(*corev1.Pod){exporter}, want: true},
		{name: "exporter pod, display none: off", mut: []func(*corev1.Pod){exporter, ann(AnnotationDisplay, "none")}},
		{name: "exporter pod, display vnc: on", mut: []func(*corev1.Pod){exporter, ann(AnnotationDisplay, "vnc")}, want: true},
		{name: "exporter pod of machine pc: on", mut: []func(*corev1.Pod){exporter, ann(AnnotationMachine, "pc")}, want: true},
		{name: "exporter pod on arm64 (virtio-gpu): on", arch: qemu.ArchAArch64, mut: []func(*corev1.Pod){exporter}, want: true},
		{name: "exporter pod of an empty disk: on", mut: []func(*corev1.Pod){exporter, emptyDisk}, want: true},
		{name: "exporter pod starting from a snapshot: on", mut: []func(*corev1.Pod){exporter, snapshotStart}, want: true},
		{name: "exporter pod, ssh Disabled: display on still", mut: []func(*corev1.Pod){exporter, ann(v1alpha1.SSHDriverAnnotation, "Disabled")}, want: true},
		{name: "exporter pod of machine microvm: off, not refused", mut: []func(*corev1.Pod){exporter, ann(AnnotationMachine, "microvm")}},
		{name: "exporter pod of machine microvm, display vnc: refused", mut: []func(*corev1.Pod){exporter, ann(AnnotationMachine, "microvm"), ann(AnnotationDisplay, "vnc")},
			want: true, refuse: "machine microvm has no graphics card"},
		{name: "non-exporter pod: off", mut: nil},
		{name: "non-exporter pod, display vnc: on", mut: []func(*corev1.Pod){ann(AnnotationDisplay, "vnc")}, want: true},
		{name: "non-exporter pod, display none: off", mut: []func(*corev1.Pod){ann(AnnotationDisplay, "none")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pod := podtest.VMPod(func(p *corev1.Pod) { p.Annotations = map[string]string{} })
			for _, m := range tc.mut {
				m(pod)
			}
			arch := tc.arch
			if arch == "" {
				arch = qemu.ArchX86_64
			}
			got, err := DisplayOf(pod)
			require.NoError(t, err)
			assert.Equal(t, tc.want, got, "DisplayOf")
			plan, rej := Translate(pod, arch)
			if tc.refuse != "" {
				require.NotNil(t, rej)
				assert.Contains(t, rej.Message, tc.refuse)
				return
			}
			require.Nil(t, rej)
			assert.Equal(t, tc.want, plan.Display, "Plan.Display")
		})
	}
}

// TestDisplayBadValue: a display other than vnc or none refuses the pod
// and keeps its exporter from starting, naming the annotation.
func TestDisplayBadValue(t *testing.T) {
	pod := podtest.VMPod(func(p *corev1.Pod) {
		p.Annotations = map[string]string{AnnotationDisplay: "spice", v1alpha1.JumpstarterSecretAnnotation: "js"}
	})
	_, rej := Translate(pod, qemu.ArchX86_64)
	require.NotNil(t, rej)
	assert.Contains(t, rej.Message, `metadata.annotations[qemu-kubelet.io/display]: display "spice": want vnc or none`)
	_, err := DisplayOf(pod)
	assert.ErrorContains(t, err, `annotation qemu-kubelet.io/display: "spice": want vnc or none`)
}

// TestTranslateSSHDriver: the exporter's ssh switch is a known annotation,
// Enabled or Disabled; anything else refuses the pod, naming it.
func TestTranslateSSHDriver(t *testing.T) {
	for _, v := range []string{"Enabled", "Disabled"} {
		pod := podtest.VMPod(func(p *corev1.Pod) { p.Annotations = map[string]string{v1alpha1.SSHDriverAnnotation: v} })
		_, rej := Translate(pod, qemu.ArchX86_64)
		assert.Nil(t, rej, v)
		on, err := SSHDriverOf(pod)
		require.NoError(t, err)
		assert.Equal(t, v == "Enabled", on, v)
	}
	on, err := SSHDriverOf(podtest.VMPod())
	require.NoError(t, err)
	assert.True(t, on, "absent: on")
	pod := podtest.VMPod(func(p *corev1.Pod) { p.Annotations = map[string]string{v1alpha1.SSHDriverAnnotation: "disabled"} })
	_, rej := Translate(pod, qemu.ArchX86_64)
	require.NotNil(t, rej)
	assert.Contains(t, rej.Message, `metadata.annotations[qemu-kubelet.io/jumpstarter-ssh]`)
	assert.Contains(t, rej.Message, `"disabled": want Enabled or Disabled`)
}

func errNotFound(resource, name string) error {
	return apierrors.NewNotFound(schema.GroupResource{Resource: resource}, name)
}
