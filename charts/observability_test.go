package charts

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
)

// TestNodeAgentObservability: the metrics flag and the container port the
// PodMonitor scrapes agree for any port, and nodeAgent.env (OTLP trace
// export) reaches the agent container next to HOST_NODE_NAME, which it
// may not override.
func TestNodeAgentObservability(t *testing.T) {
	for _, tc := range []struct {
		set      []string
		wantArg  string
		wantPort int32
	}{
		{nil, "--metrics-bind-address=:10255", 10255},
		{[]string{"nodeAgent.metrics.port=9464"}, "--metrics-bind-address=:9464", 9464},
	} {
		objs := objects(t, render(t, chartDir+"/ci/monitoring-values.yaml", tc.set...))
		ds := one[appsv1.DaemonSet](t, objs, "DaemonSet")
		c := ds.Spec.Template.Spec.Containers[0]
		assert.Contains(t, c.Args, tc.wantArg)
		var port int32
		for _, p := range c.Ports {
			if p.Name == "metrics" {
				port = p.ContainerPort
			}
		}
		assert.Equal(t, tc.wantPort, port, "containerPort metrics matches the flag")
		// The chart's own (node name; keepVMs: the pod's name and
		// namespace), then nodeAgent.env.
		require.Len(t, c.Env, 4)
		assert.Equal(t, "HOST_NODE_NAME", c.Env[0].Name)
		assert.Equal(t, "POD_NAME", c.Env[1].Name)
		assert.Equal(t, "POD_NAMESPACE", c.Env[2].Name)
		assert.Equal(t, "OTEL_EXPORTER_OTLP_ENDPOINT", c.Env[3].Name)
		assert.Equal(t, "http://otel-collector.monitoring:4318", c.Env[3].Value)
	}

	_, stderr, err := runHelm(t, templateArgs("", "nodeAgent.env[0].name=HOST_NODE_NAME", "nodeAgent.env[0].value=x")...)
	require.Error(t, err, "HOST_NODE_NAME is the chart's")
	assert.Contains(t, stderr, "env")
}
