package kubeletapi

import (
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/stretchr/testify/assert"
)

func TestGateFeatures(t *testing.T) {
	// The node's features as provider.VMs keeps them: reloaded by a Store.
	var features atomic.Pointer[config.FeatureConfig]
	features.Store(podtest.FeaturesWith(config.FeaturePortForward))
	inner := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusTeapot) })
	h := GateFeatures(inner, "n1", features.Load)
	do := func(path string) (int, string) {
		rr := httptest.NewRecorder()
		h.ServeHTTP(rr, httptest.NewRequest(http.MethodPost, path, nil))
		return rr.Code, rr.Body.String()
	}
	code, body := do("/portForward/default/p")
	assert.Equal(t, http.StatusForbidden, code)
	assert.Contains(t, body, "port-forward is disabled on node n1 (features.portForward: false")
	code, _ = do("/attach/default/p/vm")
	assert.Equal(t, http.StatusTeapot, code, "attach is on")
	code, _ = do("/containerLogs/default/p/vm")
	assert.Equal(t, http.StatusTeapot, code, "logs are not gated")

	// A reload applies to the next request.
	features.Store(podtest.FeaturesWith(config.FeatureAttach))
	code, _ = do("/portForward/default/p")
	assert.Equal(t, http.StatusTeapot, code)
	code, body = do("/attach/default/p/vm")
	assert.Equal(t, http.StatusForbidden, code)
	assert.Contains(t, body, "features.attach: false")

	for _, tt := range []struct{ path, feature string }{
		{"/portForward/ns/p", config.FeaturePortForward}, {"/attach/ns/p/c", config.FeatureAttach},
		{"/exec/ns/p/c", ""}, {"/pods", ""}, {"/portForwardx", ""},
	} {
		f, _ := GatedFeature(tt.path)
		assert.Equal(t, tt.feature, f, tt.path)
	}
}
