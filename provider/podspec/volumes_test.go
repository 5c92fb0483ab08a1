package podspec

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"

	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

// fakeSources serves fixed objects; anything else is NotFound.
func fakeSources(secrets []*corev1.Secret, cms []*corev1.ConfigMap) ConfigSources {
	return ConfigSources{
		Secret: func(_ context.Context, ns, name string) (*corev1.Secret, error) {
			for _, s := range secrets {
				if s.Namespace == ns && s.Name == name {
					return s, nil
				}
			}
			return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "secrets"}, name)
		},
		ConfigMap: func(_ context.Context, ns, name string) (*corev1.ConfigMap, error) {
			for _, c := range cms {
				if c.Namespace == ns && c.Name == name {
					return c, nil
				}
			}
			return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "configmaps"}, name)
		},
	}
}

func volPod(vols []corev1.Volume, env []corev1.EnvVar, envFrom []corev1.EnvFromSource) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "web", UID: "uid-1", Labels: map[string]string{"app": "web"}},
		Spec: corev1.PodSpec{NodeName: "n1", Volumes: vols,
			Containers: []corev1.Container{{Name: "vm", Env: env, EnvFrom: envFrom}}},
	}
}

func TestValidateGuestVolumes(t *testing.T) {
	size := resource.MustParse("1Gi")
	spec := &corev1.PodSpec{Volumes: []corev1.Volume{
		{Name: "cfg", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{}}},
		{Name: "cloud-init", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{}}},
		{Name: "much-too-long-name", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{}}},
		{Name: "env", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{}}},
		{Name: "scratch", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{SizeLimit: &size}}},
		{Name: "nosize", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}},
		{Name: "mem", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{Medium: corev1.StorageMediumMemory}}},
	}}
	got := ValidateGuestVolumes(spec, "")
	require.Len(t, got, 4, "%q", got)
	assert.Contains(t, got[0], `spec.volumes[2].name: volume "much-too-long-name"`)
	assert.Contains(t, got[1], `spec.volumes[3].name: volume name "env" is reserved`)
	assert.Contains(t, got[2], `spec.volumes[5].emptyDir.sizeLimit`)
	assert.Contains(t, got[3], `spec.volumes[6].emptyDir.medium`)
}

func TestValidateGuestEnv(t *testing.T) {
	c := &corev1.Container{Env: []corev1.EnvVar{
		{Name: "A", Value: "x"},
		{Name: "B", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.labels['app']"}}},
		{Name: "C", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "status.podIP"}}},
		{Name: "D", ValueFrom: &corev1.EnvVarSource{ResourceFieldRef: &corev1.ResourceFieldSelector{Resource: "limits.cpu"}}},
		{Name: "E", ValueFrom: &corev1.EnvVarSource{SecretKeyRef: &corev1.SecretKeySelector{Key: "k"}}},
	}}
	got := ValidateGuestEnv(c, "spec.containers[0]")
	assert.Equal(t, []string{
		`spec.containers[0].env[2].valueFrom.fieldRef: fieldRef "status.podIP" is not supported for VM pods`,
		`spec.containers[0].env[3].valueFrom: env "D": only value, secretKeyRef, configMapKeyRef and fieldRef are supported for VM pods`,
	}, got)
}

func TestPlanGuestDisks(t *testing.T) {
	ctx := context.Background()
	yes := true
	src := fakeSources(
		[]*corev1.Secret{
			{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "creds"}, Data: map[string][]byte{"user": []byte("bob"), "pass": []byte("it's")}},
			{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "seed"}, Data: map[string][]byte{"user-data": []byte("#cloud-config\n")}},
		},
		[]*corev1.ConfigMap{{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "app"}, Data: map[string]string{"a.conf": "x=1", "level": "debug"}, BinaryData: map[string][]byte{"bin": {0, 1}}}},
	)
	size := resource.MustParse("64Mi")
	pod := volPod([]corev1.Volume{
		{Name: "creds", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{SecretName: "creds"}}},
		{Name: "cfg", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{LocalObjectReference: corev1.LocalObjectReference{Name: "app"},
			Items: []corev1.KeyToPath{{Key: "a.conf", Path: "etc/a.conf"}}}}},
		{Name: "cloud-init", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{SecretName: "seed"}}},
		{Name: "opt", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{SecretName: "absent", Optional: &yes}}},
		{Name: "scratch", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{SizeLimit: &size}}},
	}, []corev1.EnvVar{
		{Name: "PLAIN", Value: "v"},
		{Name: "USER", ValueFrom: &corev1.EnvVarSource{SecretKeyRef: &corev1.SecretKeySelector{LocalObjectReference: corev1.LocalObjectReference{Name: "creds"}, Key: "user"}}},
		{Name: "POD", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.name"}}},
		{Name: "APP", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.labels['app']"}}},
		{Name: "CFG_level", Value: "override"},
	}, []corev1.EnvFromSource{{Prefix: "CFG_", ConfigMapRef: &corev1.ConfigMapEnvSource{LocalObjectReference: corev1.LocalObjectReference{Name: "app"}}}})

	disks, err := planGuestDisks(ctx, pod, src)
	require.NoError(t, err)
	require.Len(t, disks, 6)
	assert.Equal(t, guestDisk{Name: "creds", Label: "creds", Files: map[string][]byte{"user": []byte("bob"), "pass": []byte("it's")}}, disks[0])
	assert.Equal(t, map[string][]byte{"etc/a.conf": []byte("x=1")}, disks[1].Files)
	assert.Equal(t, "cidata", disks[2].Label)
	assert.Equal(t, "instance-id: uid-1\nlocal-hostname: web\n", string(disks[2].Files["meta-data"]))
	assert.Empty(t, disks[3].Files, "optional missing secret: an empty disk")
	assert.Equal(t, int64(64<<20), disks[4].ScratchBytes)
	assert.Empty(t, disks[4].Label)
	env := disks[5]
	assert.Equal(t, "env", env.Label)
	assert.Equal(t, "CFG_a.conf='x=1'\nCFG_level='override'\nPLAIN='v'\nUSER='bob'\nPOD='web'\nAPP='web'\n", string(env.Files["env"]))
	assert.Contains(t, string(env.Files["env.json"]), `"USER": "bob"`)

	// Missing objects and keys: ConfigError naming them.
	for _, tc := range []struct {
		name string
		pod  *corev1.Pod
		want string
	}{
		{"secret volume", volPod([]corev1.Volume{{Name: "s", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{SecretName: "gone"}}}}, nil, nil), `secret "gone" not found (volume "s")`},
		{"configmap volume", volPod([]corev1.Volume{{Name: "c", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{LocalObjectReference: corev1.LocalObjectReference{Name: "gone"}}}}}, nil, nil), `configmap "gone" not found (volume "c")`},
		{"item key", volPod([]corev1.Volume{{Name: "c", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{LocalObjectReference: corev1.LocalObjectReference{Name: "app"}, Items: []corev1.KeyToPath{{Key: "nope", Path: "x"}}}}}}, nil, nil), `non-existent key "nope"`},
		{"env secret key", volPod(nil, []corev1.EnvVar{{Name: "X", ValueFrom: &corev1.EnvVarSource{SecretKeyRef: &corev1.SecretKeySelector{LocalObjectReference: corev1.LocalObjectReference{Name: "creds"}, Key: "nope"}}}}, nil), "couldn't find key nope in Secret ns/creds"},
		{"envFrom configmap", volPod(nil, nil, []corev1.EnvFromSource{{ConfigMapRef: &corev1.ConfigMapEnvSource{LocalObjectReference: corev1.LocalObjectReference{Name: "gone"}}}}), `configmap "gone" not found`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := planGuestDisks(ctx, tc.pod, src)
			require.Error(t, err)
			assert.True(t, IsConfigError(err), "%v", err)
			assert.Contains(t, err.Error(), tc.want)
		})
	}
	_, err = planGuestDisks(ctx, volPod(nil, []corev1.EnvVar{{Name: "X", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "status.podIPs"}}}}, nil), src)
	require.Error(t, err)
	assert.False(t, IsConfigError(err))
	assert.Contains(t, err.Error(), `fieldRef "status.podIPs" is not supported`)
}

// TestPrepareGuestDisks makes real FAT and qcow2 images and reads them back
// with mtools and qemu-img.
func TestPrepareGuestDisks(t *testing.T) {
	testutil.SkipIfShort(t, "qemu-img")
	for _, tool := range []string{"mkfs.vfat", "mcopy", "mtype", "mlabel", "qemu-img"} {
		_, err := exec.LookPath(tool)
		require.NoError(t, err, "hack/install-deps.sh installs %s", tool)
	}
	ctx := context.Background()
	dir := t.TempDir()
	size := resource.MustParse("32Mi")
	src := fakeSources([]*corev1.Secret{{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "creds"}, Data: map[string][]byte{"token": []byte("s3cret")}}}, nil)
	pod := volPod([]corev1.Volume{
		{Name: "creds", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{SecretName: "creds"}}},
		{Name: "cloud-init", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{SecretName: "creds", Items: []corev1.KeyToPath{{Key: "token", Path: "user-data"}}}}},
		{Name: "scratch", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{SizeLimit: &size}}},
	}, []corev1.EnvVar{{Name: "GREETING", Value: "hello world"}}, nil)

	disks, err := PrepareGuestDisks(ctx, dir, pod, src)
	require.NoError(t, err)
	require.Len(t, disks, 4)
	mt := func(args ...string) string {
		t.Helper()
		cmd := exec.Command(args[0], args[1:]...)
		cmd.Env = append(os.Environ(), "MTOOLS_SKIP_CHECK=1")
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "%v: %s", args, out)
		return string(out)
	}
	assert.Equal(t, qemu.Disk{Path: filepath.Join(dir, "volumes", "creds.img"), Format: qemu.FormatRaw, ReadOnly: true, Serial: "creds"}, disks[0])
	assert.Equal(t, "s3cret", mt("mtype", "-i", disks[0].Path, "::token"))
	assert.Contains(t, mt("mlabel", "-i", disks[0].Path, "-s", "::"), "CREDS")
	assert.Contains(t, mt("mlabel", "-i", disks[1].Path, "-s", "::"), "CIDATA")
	assert.Equal(t, "s3cret", mt("mtype", "-i", disks[1].Path, "::user-data"))
	assert.Contains(t, mt("mtype", "-i", disks[1].Path, "::meta-data"), "instance-id: uid-1")
	assert.Equal(t, qemu.FormatQCOW2, disks[2].Format)
	assert.False(t, disks[2].ReadOnly)
	info, err := qemu.InspectImage(ctx, disks[2].Path)
	require.NoError(t, err)
	assert.Equal(t, int64(32<<20), info.VirtualSize)
	assert.Equal(t, "GREETING='hello world'\n", mt("mtype", "-i", disks[3].Path, "::env"))
	assert.Contains(t, mt("mlabel", "-i", disks[3].Path, "-s", "::"), "ENV")

	// The next run: config disks rebuilt with new content, scratch kept.
	src.Secret = fakeSources([]*corev1.Secret{{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "creds"}, Data: map[string][]byte{"token": []byte("rotated")}}}, nil).Secret
	marker := []byte("guest wrote this")
	f, err := os.OpenFile(disks[2].Path, os.O_WRONLY|os.O_APPEND, 0)
	require.NoError(t, err)
	_, err = f.Write(marker) // stands in for guest writes: the file must survive
	require.NoError(t, err)
	f.Close()
	disks, err = PrepareGuestDisks(ctx, dir, pod, src)
	require.NoError(t, err)
	assert.Equal(t, "rotated", mt("mtype", "-i", disks[0].Path, "::token"))
	b, err := os.ReadFile(disks[2].Path)
	require.NoError(t, err)
	assert.True(t, strings.HasSuffix(string(b), string(marker)), "scratch disk kept across runs")
}

// TestExporterSecretVolumeStaysOnHost: the volume that references the pod's
// Jumpstarter exporter Secret (so the Node authorizer lets the node read
// it) is never a guest disk, whatever its name; any other secret volume of
// the same pod still is.
func TestExporterSecretVolumeStaysOnHost(t *testing.T) {
	vols := []corev1.Volume{
		{Name: "jumpstarter-credentials", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{SecretName: "board-0-js"}}},
		{Name: "creds", VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{SecretName: "creds"}}},
	}
	spec := &corev1.PodSpec{Volumes: vols}
	assert.Empty(t, ValidateGuestVolumes(spec, "board-0-js"), "the exporter secret's volume is not a guest disk: its name is free")
	got := ValidateGuestVolumes(spec, "")
	require.Len(t, got, 1, "without the annotation it is an ordinary guest disk: %q", got)
	assert.Contains(t, got[0], `volume "jumpstarter-credentials" becomes a disk`)

	src := fakeSources([]*corev1.Secret{
		{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "board-0-js"}, Data: map[string][]byte{"token": []byte("secret-token")}},
		{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "creds"}, Data: map[string][]byte{"user": []byte("bob")}},
	}, nil)
	pod := volPod(vols, nil, nil)
	pod.Annotations = map[string]string{v1alpha1.JumpstarterSecretAnnotation: "board-0-js"}
	disks, err := planGuestDisks(context.Background(), pod, src)
	require.NoError(t, err)
	require.Len(t, disks, 1)
	assert.Equal(t, "creds", disks[0].Name, "only the other secret reaches the guest")
	for _, d := range disks {
		for _, b := range d.Files {
			assert.NotContains(t, string(b), "secret-token")
		}
	}
}
