package podspec

import (
	"strings"
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
		v1alpha1.LeaseHooksAnnotation:       `{"beforeLease":{"actions":[{"action":"powerOn"}],"timeout":30,"onFailure":"endLease"},"afterLease":{"actions":[{"action":"reset"},{"action":"exec","command":["/bin/sh","-c","rm -f /tmp/x"]},{"action":"flash","flash":{"image":"reg.example/fw@sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","partition":"bios"}},{"action":"powerOff"}]}}`,
	}))
	require.NoError(t, err)
	assert.Equal(t, LeaseSettings{Keep: true,
		BeforeLease: &LeaseHookSettings{Actions: []v1alpha1.LeaseHookStep{{Action: "powerOn"}}, Timeout: 30 * time.Second, OnFailure: v1alpha1.LeaseHookEndLease},
		AfterLease: &LeaseHookSettings{Actions: []v1alpha1.LeaseHookStep{{Action: "reset"}, {Action: "exec", Command: []string{"/bin/sh", "-c", "rm -f /tmp/x"}},
			{Action: "flash", Flash: &v1alpha1.LeaseHookFlashSpec{Image: "reg.example/fw@sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", Partition: "bios"}}, {Action: "powerOff"}},
			Timeout: DefaultLeaseHookTimeout, OnFailure: v1alpha1.LeaseHookWarn},
	}, ls)

	// Hostile or mistaken values: a clear error naming the annotation.
	for _, c := range []struct {
		name, key, value, want string
	}{
		{"unknown policy", v1alpha1.LeaseStatePolicyAnnotation, "keep", `lease state policy "keep": want Reset or Keep`},
		{"not JSON", v1alpha1.LeaseHooksAnnotation, `{"beforeLease":`, "not lease hooks as JSON"},
		{"unknown field (a script)", v1alpha1.LeaseHooksAnnotation, `{"beforeLease":{"script":"rm -rf /"}}`, `unknown field "script"`},
		{"an action as a plain string", v1alpha1.LeaseHooksAnnotation, `{"afterLease":{"actions":["powerOn"]}}`, "not lease hooks as JSON"},
		{"no actions", v1alpha1.LeaseHooksAnnotation, `{"afterLease":{"actions":[]}}`, "afterLease: 0 actions: want 1 to 8"},
		{"too many actions", v1alpha1.LeaseHooksAnnotation, `{"afterLease":{"actions":[` + strings.Repeat(`{"action":"powerOn"},`, 8) + `{"action":"powerOn"}]}}`, "9 actions"},
		{"unknown action", v1alpha1.LeaseHooksAnnotation, `{"beforeLease":{"actions":[{"action":"script"}]}}`, `actions[0]: action "script": want powerOn, powerOff, powerCycle, reset, exec or flash`},
		{"exec without a command", v1alpha1.LeaseHooksAnnotation, `{"beforeLease":{"actions":[{"action":"exec"}]}}`, "beforeLease: actions[0]: exec: command has 0 arguments: want 1 to 64"},
		{"exec with an empty command", v1alpha1.LeaseHooksAnnotation, `{"beforeLease":{"actions":[{"action":"exec","command":[]}]}}`, "command has 0 arguments"},
		{"exec with an empty program", v1alpha1.LeaseHooksAnnotation, `{"afterLease":{"actions":[{"action":"powerOn"},{"action":"exec","command":[""]}]}}`, "afterLease: actions[1]: exec: command argument 0 is empty"},
		{"exec with too many arguments", v1alpha1.LeaseHooksAnnotation, `{"afterLease":{"actions":[{"action":"exec","command":["a"` + strings.Repeat(`,"a"`, 64) + `]}]}}`, "command has 65 arguments: want 1 to 64"},
		{"exec with a too long argument", v1alpha1.LeaseHooksAnnotation, `{"afterLease":{"actions":[{"action":"exec","command":["echo","` + strings.Repeat("x", 4097) + `"]}]}}`, "command argument 1 has 4097 bytes: at most 4096"},
		{"exec with a NUL byte", v1alpha1.LeaseHooksAnnotation, `{"afterLease":{"actions":[{"action":"exec","command":["echo","a\u0000b"]}]}}`, "command argument 1 contains a NUL byte"},
		{"a command on another action", v1alpha1.LeaseHooksAnnotation, `{"afterLease":{"actions":[{"action":"powerOff","command":["true"]}]}}`, "action powerOff takes no command"},
		{"flash without its image", v1alpha1.LeaseHooksAnnotation, `{"afterLease":{"actions":[{"action":"flash"}]}}`, "actions[0]: flash: no image"},
		{"flash of an image without tag or digest", v1alpha1.LeaseHooksAnnotation, `{"afterLease":{"actions":[{"action":"flash","flash":{"image":"reg.example/os"}}]}}`, `flash: image "reg.example/os": want an OCI reference with a tag or a digest`},
		{"flash of an oci:// URL", v1alpha1.LeaseHooksAnnotation, `{"afterLease":{"actions":[{"action":"flash","flash":{"image":"oci://reg.example/os:1"}}]}}`, "want an OCI reference"},
		{"flash onto an unknown partition", v1alpha1.LeaseHooksAnnotation, `{"afterLease":{"actions":[{"action":"flash","flash":{"image":"reg.example/os:1","partition":"efi"}}]}}`, `flash: partition "efi": want one of root, bios, OVMF_CODE.fd, OVMF_VARS.fd`},
		{"a flash on another action", v1alpha1.LeaseHooksAnnotation, `{"afterLease":{"actions":[{"action":"reset","flash":{"image":"reg.example/os:1"}}]}}`, "action reset takes no flash"},
		{"negative timeout", v1alpha1.LeaseHooksAnnotation, `{"beforeLease":{"actions":[{"action":"powerOn"}],"timeout":-1}}`, "timeout -1 s"},
		{"huge timeout", v1alpha1.LeaseHooksAnnotation, `{"beforeLease":{"actions":[{"action":"powerOn"}],"timeout":99999}}`, "timeout 99999 s"},
		{"unknown onFailure", v1alpha1.LeaseHooksAnnotation, `{"beforeLease":{"actions":[{"action":"powerOn"}],"onFailure":"ignore"}}`, `onFailure "ignore"`},
	} {
		_, err := LeaseSettingsOf(podWithLease(map[string]string{c.key: c.value}))
		require.Error(t, err, c.name)
		assert.Contains(t, err.Error(), c.key, c.name)
		assert.Contains(t, err.Error(), c.want, c.name)
	}
}
