package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestLoadConfig(t *testing.T) {
	dir := t.TempDir()
	write := func(body string) string {
		p := filepath.Join(dir, "node.yaml")
		require.NoError(t, os.WriteFile(p, []byte("apiVersion: qemu-kubelet.io/v1alpha1\nkind: NodeConfiguration\n"+body), 0o600))
		return p
	}
	tests := []struct {
		name     string
		body     string
		flagName string
		wantName string
		wantErr  []string
	}{
		{name: "file name", body: "nodeName: from-file\n", wantName: "from-file"},
		{name: "flag overrides file", body: "nodeName: from-file\n", flagName: "from-flag", wantName: "from-flag"},
		{name: "invalid flag value named", body: "", flagName: "Bad_Name", wantErr: []string{"nodeName", "Bad_Name"}},
		{name: "invalid file value names file and field", body: "maxVMs: 0\n", wantErr: []string{"node.yaml", "maxVMs"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n, err := loadConfig(options{configFile: write(tt.body), nodeName: tt.flagName})
			if len(tt.wantErr) > 0 {
				require.Error(t, err)
				for _, w := range tt.wantErr {
					assert.Contains(t, err.Error(), w)
				}
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tt.wantName, n.NodeName)
		})
	}

	// No --config: all defaults, still a valid node.
	n, err := loadConfig(options{nodeName: "only-flag"})
	require.NoError(t, err)
	assert.Equal(t, "only-flag", n.NodeName)
	assert.Equal(t, int32(10250), n.Port)
}

// TestLoadConfigAPIBudget: --kube-api-qps/--kube-api-burst override the file,
// and a burst below the QPS is refused naming the field.
func TestLoadConfigAPIBudget(t *testing.T) {
	p := filepath.Join(t.TempDir(), "node.yaml")
	require.NoError(t, os.WriteFile(p, []byte("apiVersion: qemu-kubelet.io/v1alpha1\nkind: NodeConfiguration\nkubeAPIQPS: 10\nkubeAPIBurst: 20\n"), 0o600))

	n, err := loadConfig(options{configFile: p})
	require.NoError(t, err)
	assert.Equal(t, float32(10), n.KubeAPIQPS)
	assert.Equal(t, 20, n.KubeAPIBurst)

	n, err = loadConfig(options{configFile: p, kubeAPIQPS: 70, kubeAPIBurst: 140})
	require.NoError(t, err)
	assert.Equal(t, float32(70), n.KubeAPIQPS)
	assert.Equal(t, 140, n.KubeAPIBurst)

	_, err = loadConfig(options{configFile: p, kubeAPIQPS: 70})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "kubeAPIBurst")
}
