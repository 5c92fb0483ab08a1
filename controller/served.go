package controller

import (
	"context"
	"fmt"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/wait"
	ctrl "sigs.k8s.io/controller-runtime"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
)

// discoveryPatience is how long Served retries a discovery request that
// fails for another reason than "no such kind" (an API server starting or
// busy) before it gives up with an error.
var discoveryPatience = 30 * time.Second

// Served reports whether the manager's scheme has each kind of gv and the
// API server serves it. The answer is read once, when a controller is set
// up, and decides what it watches for its whole life: only the API
// server's "no such kind" is false; any other failure of discovery is
// retried for discoveryPatience and then returned as an error, so that a
// busy API server at start makes the process fail (and be restarted), not
// serve sets without the kinds it needs until someone restarts it.
func Served(mgr ctrl.Manager, gv schema.GroupVersion, kinds ...string) (bool, error) {
	return servedBy(mgr.GetScheme(), mgr.GetRESTMapper(), gv, kinds, discoveryPatience, time.Second)
}

// jumpstarterServed: Served for Jumpstarter's Exporter and Lease.
func jumpstarterServed(mgr ctrl.Manager) (bool, error) {
	return Served(mgr, jsv1.GroupVersion, "Exporter", "Lease")
}

func servedBy(scheme *runtime.Scheme, mapper meta.RESTMapper, gv schema.GroupVersion, kinds []string, patience, interval time.Duration) (bool, error) {
	for _, kind := range kinds {
		if !scheme.Recognizes(gv.WithKind(kind)) {
			return false, nil
		}
	}
	served := false
	var last error
	ctx, cancel := context.WithTimeout(context.Background(), patience)
	defer cancel()
	err := wait.PollUntilContextCancel(ctx, interval, true, func(context.Context) (bool, error) {
		served, last = true, nil
		for _, kind := range kinds {
			_, err := mapper.RESTMapping(schema.GroupKind{Group: gv.Group, Kind: kind}, gv.Version)
			switch {
			case err == nil:
			case meta.IsNoMatchError(err):
				served = false
				return true, nil
			default:
				last = err
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		if last == nil {
			last = err
		}
		return false, fmt.Errorf("discover whether the API server serves %s %v (tried for %s): %w", gv, kinds, patience, last)
	}
	return served, nil
}
