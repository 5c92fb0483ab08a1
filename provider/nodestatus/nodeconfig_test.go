package nodestatus

import (
	"context"
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
)

func TestConfigConditionAndFeaturesAnnotation(t *testing.T) {
	tests := []struct {
		name    string
		cs      ConfigState
		status  corev1.ConditionStatus
		reason  string
		message []string
	}{
		{"default configuration", ConfigState{}, corev1.ConditionTrue, ReasonConfigApplied, []string{"default configuration (no --config file) in force"}},
		{"file in force", ConfigState{Source: "/etc/n.yaml"}, corev1.ConditionTrue, ReasonConfigApplied, []string{"config file /etc/n.yaml in force"}},
		{"rejected", ConfigState{Source: "/etc/n.yaml", Error: `unknown field "features.bogus"`}, corev1.ConditionFalse, ReasonConfigInvalid,
			[]string{"config file /etc/n.yaml rejected, the previous configuration stays in force", `unknown field "features.bogus"`}},
		{"restart required", ConfigState{Source: "/etc/n.yaml", RestartRequired: []string{"stateDir", "maxVMs"}}, corev1.ConditionFalse, ReasonRestartRequired,
			[]string{"features applied", "after a restart: stateDir, maxVMs"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := configCondition(tt.cs)
			assert.Equal(t, ConditionConfigOK, c.Type)
			assert.Equal(t, tt.status, c.Status)
			assert.Equal(t, tt.reason, c.Reason)
			for _, m := range tt.message {
				assert.Contains(t, c.Message, m)
			}
		})
	}

	// The node shows the features in force: the file's at start, the
	// reloaded ones after SetConfigState, pushed at once.
	cfg := resolve(t, "features: {uefi: false}\n")
	f := facts(cfg)
	f.ConfigState.Source = "/etc/n.yaml"
	h := healthyHost()
	s := NewNodeStatus(context.Background(), f, func() (HostReadings, error) { return h, nil })
	reg := s.RegistrationNode()
	assert.Equal(t, "attach=true,jumpstarterExporter=true,portForward=true,uefi=false,consoleLogSize=8Mi", reg.Annotations[AnnotationFeatures])
	assert.Equal(t, ReasonConfigApplied, condMap(reg.Status.Conditions)[ConditionConfigOK].Reason)
	var got []*corev1.Node
	s.NotifyNodeStatus(context.Background(), func(n *corev1.Node) { got = append(got, n) })
	s.SetConfigState(context.Background(), ConfigState{Source: "/etc/n.yaml", Features: config.DefaultFeatures(), RestartRequired: []string{"maxVMs"}})
	require.Len(t, got, 1)
	assert.Equal(t, "attach=true,jumpstarterExporter=true,portForward=true,uefi=true,consoleLogSize=8Mi", got[0].Annotations[AnnotationFeatures])
	c := condMap(got[0].Status.Conditions)[ConditionConfigOK]
	assert.Equal(t, corev1.ConditionFalse, c.Status)
	assert.Equal(t, ReasonRestartRequired, c.Reason)
}
