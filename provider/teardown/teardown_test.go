package teardown

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/qemu"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
)

// TestOwnerGone: VMs stop only when the agent's DaemonSet is gone for
// good; an upgrade (same DaemonSet) or an unreadable answer keeps them.
func TestOwnerGone(t *testing.T) {
	ds := func(uid string, deleting bool) *appsv1.DaemonSet {
		d := &appsv1.DaemonSet{ObjectMeta: metav1.ObjectMeta{Name: "qk-node", UID: types.UID("ds-" + uid)}}
		if deleting {
			now := metav1.Now()
			d.DeletionTimestamp = &now
		}
		return d
	}
	gr := schema.GroupResource{Group: "apps", Resource: "daemonsets"}
	for _, tc := range []struct {
		name string
		ds   *appsv1.DaemonSet
		err  error
		gone bool
	}{
		{"same DaemonSet (upgrade, restart)", ds("1", false), nil, false},
		{"deleted", nil, apierrors.NewNotFound(gr, "qk-node"), true},
		{"being deleted", ds("1", true), nil, true},
		{"reinstalled under the same name", ds("2", false), nil, true},
		{"credentials revoked", nil, apierrors.NewUnauthorized("token revoked"), true},
		{"forbidden: cannot tell", nil, apierrors.NewForbidden(gr, "qk-node", errors.New("no")), false},
		{"API down: cannot tell", nil, errors.New("connection refused"), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gone, why := OwnerGone("ds-1", tc.ds, tc.err)
			assert.Equal(t, tc.gone, gone, why)
			assert.NotEmpty(t, why)
		})
	}
}

// stopVM is a VM as StopAllVMs adopts it: running until stopped (or
// already ended), or failing to stop.
type stopVM struct {
	mu      *sync.Mutex // guards what stopped and grace point to
	exited  bool
	stopErr error
	stopped *[]string
	dir     string
	grace   *time.Duration
}

func (v *stopVM) Exit() (qemu.Exit, bool) { return qemu.Exit{}, v.exited }

func (v *stopVM) Stop(_ context.Context, opts qemu.StopOptions) (qemu.Exit, error) {
	if v.stopErr != nil {
		return qemu.Exit{}, v.stopErr
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	*v.stopped = append(*v.stopped, filepath.Base(v.dir))
	*v.grace = opts.Grace
	return qemu.Exit{}, nil
}

// TestStopAllVMs: every VM dir with a spec is adopted; running VMs are
// stopped within the grace, ended ones left as they are, and the VMs that
// cannot be adopted or stopped are errors that name them; dirs without a
// spec and files are not VMs. No vms dir: nothing to stop.
func TestStopAllVMs(t *testing.T) {
	n, err := StopAllVMs(context.Background(), nil, filepath.Join(t.TempDir(), "missing"), time.Second)
	require.NoError(t, err)
	assert.Zero(t, n)

	dir := t.TempDir()
	for _, d := range []string{"running", "ended", "unadoptable", "stuck", "nospec"} {
		require.NoError(t, os.MkdirAll(filepath.Join(dir, d), 0o700))
		if d != "nospec" {
			require.NoError(t, os.WriteFile(filepath.Join(dir, d, qemu.SpecFileName), []byte("{}"), 0o600))
		}
	}
	require.NoError(t, os.WriteFile(filepath.Join(dir, "a-file"), nil, 0o600))
	var (
		mu      sync.Mutex
		adopted []string
		stopped []string
		grace   time.Duration
	)
	adopt := func(_ context.Context, d string) (VM, error) {
		mu.Lock()
		defer mu.Unlock()
		adopted = append(adopted, filepath.Base(d))
		v := &stopVM{mu: &mu, stopped: &stopped, dir: d, grace: &grace}
		switch filepath.Base(d) {
		case "ended":
			v.exited = true
		case "unadoptable":
			return nil, errors.New("no QMP socket")
		case "stuck":
			v.stopErr = errors.New("kill failed")
		}
		return v, nil
	}
	n, err = StopAllVMs(context.Background(), adopt, dir, 7*time.Second)
	mu.Lock()
	defer mu.Unlock()
	assert.Equal(t, 1, n, "one running VM stopped")
	assert.ElementsMatch(t, []string{"running", "ended", "unadoptable", "stuck"}, adopted, "every VM dir with a spec, nothing else")
	assert.Equal(t, []string{"running"}, stopped)
	assert.Equal(t, 7*time.Second, grace)
	require.Error(t, err)
	assert.Contains(t, err.Error(), filepath.Join(dir, "unadoptable")+": no QMP socket")
	assert.Contains(t, err.Error(), filepath.Join(dir, "stuck")+": kill failed")
}
