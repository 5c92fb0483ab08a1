package controller

import (
	"context"
	"errors"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stypes "k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

func TestGeneratesLogin(t *testing.T) {
	snap := map[string]string{v1alpha1.StartFromSnapshotAnnotation: "true"}
	for _, c := range []struct {
		spec v1alpha1.JumpstarterSpec
		ann  map[string]string
		want bool
	}{
		{v1alpha1.JumpstarterSpec{}, nil, true},
		{v1alpha1.JumpstarterSpec{DefaultGuestLogin: v1alpha1.DefaultGuestLoginGenerate}, nil, true},
		{v1alpha1.JumpstarterSpec{}, map[string]string{v1alpha1.StartFromSnapshotAnnotation: "false"}, true},
		{v1alpha1.JumpstarterSpec{DefaultGuestLogin: v1alpha1.DefaultGuestLoginNone}, nil, false},
		{v1alpha1.JumpstarterSpec{GuestLoginSecretName: "login"}, nil, false},
		{v1alpha1.JumpstarterSpec{GuestLoginSecretName: "login", DefaultGuestLogin: v1alpha1.DefaultGuestLoginGenerate}, nil, false},
		{v1alpha1.JumpstarterSpec{}, snap, false},
	} {
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Annotations: c.ann}}
		assert.Equal(t, c.want, generatesLogin(&c.spec, pod), "%+v %v", c.spec, c.ann)
	}
}

type failingReader struct{}

func (failingReader) Read([]byte) (int, error) { return 0, errors.New("entropy source closed") }

// TestGeneratePassword: 32 URL-safe characters (192 bits), a new one each
// time; a failing random source is an error, never a weak password.
func TestGeneratePassword(t *testing.T) {
	seen := map[string]bool{}
	for i := 0; i < 100; i++ {
		p, err := generatePassword(strings.NewReader(strings.Repeat(string(rune('a'+i%26)), 24)))
		require.NoError(t, err)
		assert.Len(t, p, 32)
		seen[p] = true
	}
	assert.Len(t, seen, 26, "the password is the random bytes' encoding")
	a, err := generatePasswordCrypto()
	require.NoError(t, err)
	b, err := generatePasswordCrypto()
	require.NoError(t, err)
	assert.NotEqual(t, a, b)
	assert.Regexp(t, regexp.MustCompile(`^[A-Za-z0-9_-]{32}$`), a)
	_, err = generatePassword(failingReader{})
	assert.ErrorContains(t, err, "generate a guest password: entropy source closed")
}

// generatePasswordCrypto is what the controller uses.
func generatePasswordCrypto() (string, error) {
	u, p, reason := jsClient{}.guestLogin(context.Background(), jsTarget{Spec: &v1alpha1.JumpstarterSpec{}}, &corev1.Pod{})
	if reason != "" {
		return "", errors.New(reason)
	}
	if string(u) != v1alpha1.GeneratedGuestLoginUser {
		return "", errors.New("user " + string(u))
	}
	return string(p), nil
}

// TestWriteExporterSecretDefaultLogin: a set that names no login writes a
// generated one into each pod's exporter Secret, which the pod owns (so
// the login goes with the pod), one per pod; defaultGuestLogin None writes
// none.
func TestWriteExporterSecretDefaultLogin(t *testing.T) {
	ctx := context.Background()
	scheme := runtime.NewScheme()
	require.NoError(t, corev1.AddToScheme(scheme))
	require.NoError(t, jsv1.AddToScheme(scheme))
	pod := func(name string) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", UID: k8stypes.UID("uid-" + name),
			Annotations: map[string]string{v1alpha1.JumpstarterSecretAnnotation: exporterSecretName(name)}}}
	}
	exp := func(name string) *jsv1.Exporter {
		return &jsv1.Exporter{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns"},
			Status: jsv1.ExporterStatus{Credential: &corev1.LocalObjectReference{Name: name + "-exporter"}, Endpoint: "js:8082"}}
	}
	cred := func(name string) *corev1.Secret {
		return &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name + "-exporter", Namespace: "ns"}, Data: map[string][]byte{"token": []byte("tok")}}
	}
	c := fake.NewClientBuilder().WithScheme(scheme).WithObjects(pod("a"), pod("b"), pod("c"), cred("a"), cred("b"), cred("c")).Build()
	js := jsClient{Client: c, Reader: c}
	set := ourJS(&v1alpha1.ExporterSet{ObjectMeta: metav1.ObjectMeta{Name: "s", Namespace: "ns", UID: "set-uid"},
		Spec: v1alpha1.ExporterSetSpec{Jumpstarter: &v1alpha1.JumpstarterSpec{ExporterLabels: map[string]string{"b": "x"}}}})
	written := func(name string) *corev1.Secret {
		var s corev1.Secret
		require.NoError(t, c.Get(ctx, client.ObjectKey{Namespace: "ns", Name: exporterSecretName(name)}, &s))
		return &s
	}
	passwords := map[string]bool{}
	for _, n := range []string{"a", "b"} {
		p := pod(n)
		require.Empty(t, js.writeExporterSecret(ctx, set, p, exp(n)))
		s := written(n)
		assert.Equal(t, v1alpha1.GeneratedGuestLoginUser, string(s.Data[v1alpha1.JumpstarterSecretUsername]))
		assert.Len(t, s.Data[v1alpha1.JumpstarterSecretPassword], 32)
		passwords[string(s.Data[v1alpha1.JumpstarterSecretPassword])] = true
		assert.True(t, metav1.IsControlledBy(s, p), "the pod owns its login: %v", s.OwnerReferences)
	}
	assert.Len(t, passwords, 2, "one login per pod")

	set.Spec = &v1alpha1.JumpstarterSpec{ExporterLabels: map[string]string{"b": "x"}, DefaultGuestLogin: v1alpha1.DefaultGuestLoginNone}
	require.Empty(t, js.writeExporterSecret(ctx, set, pod("c"), exp("c")))
	s := written("c")
	assert.NotContains(t, s.Data, v1alpha1.JumpstarterSecretUsername, "defaultGuestLogin None: no login")
	assert.NotContains(t, s.Data, v1alpha1.JumpstarterSecretPassword)
	assert.Equal(t, "tok", string(s.Data[v1alpha1.JumpstarterSecretToken]))
}
