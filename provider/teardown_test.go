package provider

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
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
