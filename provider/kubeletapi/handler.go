// Package kubeletapi is the HTTP side of the node's kubelet API: the
// routes (virtual-kubelet's PodHandler with port-forward's stream timeouts
// the right way round, Handler) and the gate that refuses the requests of
// disabled features (GateFeatures). What each route does for a pod is
// package provider's (the VMs methods in provider/kubeletapi.go), which
// cmd passes in through api.PodHandlerConfig.
//
// kubeletapi knows the node's feature configuration and the
// virtual-kubelet API types; it knows nothing of pods or VMs.
package kubeletapi

import (
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/gorilla/mux"
	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
)

// Kubelet streaming defaults: a session may stay idle this long (the
// kubelet's streamingConnectionIdleTimeout), and a client has this long to
// open its streams after the upgrade.
const (
	DefaultStreamIdleTimeout     = 4 * time.Hour
	DefaultStreamCreationTimeout = 30 * time.Second
)

// Handler is api.PodHandler (virtual-kubelet v1.13) with the
// port-forward route fixed: PodHandler passes StreamCreationTimeout as the
// port-forward idle timeout and StreamIdleTimeout as its creation timeout
// (swapped), so a quiet `kubectl port-forward` would be cut after the
// creation timeout. Here port-forward gets them the right way round; every
// other route is PodHandler's. Zero timeouts take the kubelet defaults
// above (PodHandler's own default, 30 s idle, would also end an idle
// `kubectl attach -it` after 30 s).
func Handler(cfg api.PodHandlerConfig, debug bool) http.Handler {
	if cfg.StreamIdleTimeout <= 0 {
		cfg.StreamIdleTimeout = DefaultStreamIdleTimeout
	}
	if cfg.StreamCreationTimeout <= 0 {
		cfg.StreamCreationTimeout = DefaultStreamCreationTimeout
	}
	r := mux.NewRouter()
	r.StrictSlash(true)
	r.HandleFunc("/portForward/{namespace}/{pod}", api.HandlePortForward(cfg.PortForward,
		api.WithPortForwardStreamIdleTimeout(cfg.StreamIdleTimeout),
		api.WithPortForwardCreationTimeout(cfg.StreamCreationTimeout),
	)).Methods("POST", "GET")
	r.NotFoundHandler = api.PodHandler(cfg, debug)
	return r
}

// kubeletAPIFeatures maps kubelet API path prefixes to the feature that
// serves them.
var kubeletAPIFeatures = []struct{ prefix, feature, what string }{
	{"/portForward/", config.FeaturePortForward, "port-forward"},
	{"/attach/", config.FeatureAttach, "attach"},
}

// GatedFeature is the feature a kubelet API request path needs ("" for
// none) and what it is called. Pure.
func GatedFeature(path string) (feature, what string) {
	for _, g := range kubeletAPIFeatures {
		if strings.HasPrefix(path, g.prefix) {
			return g.feature, g.what
		}
	}
	return "", ""
}

// GateFeatures refuses kubelet API requests for features disabled on node
// nodeName (403, naming the setting) and passes the others to h. The
// features are read per request (features, e.g. provider.VMs.Features): a
// reload applies to the next request.
func GateFeatures(h http.Handler, nodeName string, features func() *config.FeatureConfig) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if f, what := GatedFeature(r.URL.Path); f != "" && !features().Enabled(f) {
			http.Error(w, fmt.Sprintf("%s is disabled on node %s (features.%s: false in its configuration)", what, nodeName, f), http.StatusForbidden)
			return
		}
		h.ServeHTTP(w, r)
	})
}
