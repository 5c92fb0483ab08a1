package controller

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
)

// flakyMapper answers RESTMapping with fail's errors first (one per call),
// then with answer.
type flakyMapper struct {
	meta.RESTMapper
	fail   []error
	answer error
	calls  int
}

func (m *flakyMapper) RESTMapping(gk schema.GroupKind, versions ...string) (*meta.RESTMapping, error) {
	m.calls++
	if len(m.fail) > 0 {
		err := m.fail[0]
		m.fail = m.fail[1:]
		return nil, err
	}
	if m.answer != nil {
		return nil, m.answer
	}
	return &meta.RESTMapping{GroupVersionKind: schema.GroupVersionKind{Group: gk.Group, Version: versions[0], Kind: gk.Kind}}, nil
}

// TestServedRetriesDiscoveryFailures: whether Jumpstarter's kinds are
// served is decided once, at setup, for the controller's life. A
// discovery request that fails (an API server busy or starting: seen as a
// provisioner that never made a pod in a loaded CI run) is asked again, not
// taken for "not served"; only the API server's "no such kind" is false;
// discovery that never answers is an error naming what was asked.
func TestServedRetriesDiscoveryFailures(t *testing.T) {
	scheme := runtime.NewScheme()
	require.NoError(t, jsv1.AddToScheme(scheme))
	kinds := []string{"Exporter", "Lease"}
	busy := errors.New("the server is currently unable to handle the request")
	noMatch := &meta.NoKindMatchError{GroupKind: schema.GroupKind{Group: jsv1.GroupVersion.Group, Kind: "Exporter"}}

	m := &flakyMapper{fail: []error{busy, busy}}
	ok, err := servedBy(scheme, m, jsv1.GroupVersion, kinds, 5*time.Second, time.Millisecond)
	require.NoError(t, err)
	assert.True(t, ok, "served once discovery answers")
	assert.Equal(t, 4, m.calls, "two failures, then both kinds")

	m = &flakyMapper{answer: noMatch}
	ok, err = servedBy(scheme, m, jsv1.GroupVersion, kinds, 5*time.Second, time.Millisecond)
	require.NoError(t, err)
	assert.False(t, ok, "no such kind: not served")
	assert.Equal(t, 1, m.calls, "an answer is not asked again")

	m = &flakyMapper{answer: busy}
	ok, err = servedBy(scheme, m, jsv1.GroupVersion, kinds, 50*time.Millisecond, time.Millisecond)
	require.Error(t, err)
	assert.False(t, ok)
	assert.ErrorIs(t, err, busy)
	assert.Contains(t, err.Error(), jsv1.GroupVersion.String())

	m = &flakyMapper{}
	ok, err = servedBy(runtime.NewScheme(), m, jsv1.GroupVersion, kinds, time.Second, time.Millisecond)
	require.NoError(t, err)
	assert.False(t, ok, "a kind the scheme lacks is not served")
	assert.Zero(t, m.calls)
}
