package podspec

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

func podWithLease(ann map[string]string) *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Annotations: ann}}
}

func TestLeaseSettingsOf(t *testing.T) {
	ls, err := LeaseSettingsOf(podWithLease(nil))
	require.NoError(t, err)
	assert.Equal(t, LeaseSettings{}, ls, "no annotations: Reset, no hooks")

	ls, err = LeaseSettingsOf(podWithLease(map[string]string{
		v1alpha1.LeaseStatePolicyAnnotation: "Keep",
		v1alpha1.LeaseHooksAnnotation:       `{"beforeLease":{"actions":["powerOn"],"timeout":30,"onFailure":"endLease"},"afterLease":{"actions":["reset","powerOff"]}}`,
	}))
	require.NoError(t, err)
	assert.Equal(t, LeaseSettings{Keep: true,
		BeforeLease: &LeaseHookSettings{Actions: []v1alpha1.LeaseHookAction{"powerOn"}, Timeout: 30 * time.Second, OnFailure: v1alpha1.LeaseHookEndLease},
		AfterLease:  &LeaseHookSettings{Actions: []v1alpha1.LeaseHookAction{"reset", "powerOff"}, Timeout: DefaultLeaseHookTimeout, OnFailure: v1alpha1.LeaseHookWarn},
	}, ls)

	// Hostile or mistaken values: a clear error naming the annotation.
	for _, c := range []struct {
		name, key, value, want string
	}{
		{"unknown policy", v1alpha1.LeaseStatePolicyAnnotation, "keep", `lease state policy "keep": want Reset or Keep`},
		{"not JSON", v1alpha1.LeaseHooksAnnotation, `{"beforeLease":`, "not lease hooks as JSON"},
		{"unknown field (a script)", v1alpha1.LeaseHooksAnnotation, `{"beforeLease":{"script":"rm -rf /"}}`, `unknown field "script"`},
		{"no actions", v1alpha1.LeaseHooksAnnotation, `{"afterLease":{"actions":[]}}`, "afterLease: 0 actions: want 1 to 8"},
		{"too many actions", v1alpha1.LeaseHooksAnnotation, `{"afterLease":{"actions":["powerOn","powerOn","powerOn","powerOn","powerOn","powerOn","powerOn","powerOn","powerOn"]}}`, "9 actions"},
		{"unknown action", v1alpha1.LeaseHooksAnnotation, `{"beforeLease":{"actions":["exec"]}}`, `action "exec": want powerOn, powerOff, powerCycle or reset`},
		{"negative timeout", v1alpha1.LeaseHooksAnnotation, `{"beforeLease":{"actions":["powerOn"],"timeout":-1}}`, "timeout -1 s"},
		{"huge timeout", v1alpha1.LeaseHooksAnnotation, `{"beforeLease":{"actions":["powerOn"],"timeout":99999}}`, "timeout 99999 s"},
		{"unknown onFailure", v1alpha1.LeaseHooksAnnotation, `{"beforeLease":{"actions":["powerOn"],"onFailure":"ignore"}}`, `onFailure "ignore"`},
	} {
		_, err := LeaseSettingsOf(podWithLease(map[string]string{c.key: c.value}))
		require.Error(t, err, c.name)
		assert.Contains(t, err.Error(), c.key, c.name)
		assert.Contains(t, err.Error(), c.want, c.name)
	}
}
