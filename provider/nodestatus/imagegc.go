package nodestatus

import (
	"context"
	"fmt"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/oci"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/klog/v2"
)

// Node event reasons of the image cache garbage collection.
const (
	// ReasonImagesRemoved: GC removed unused images (Normal).
	ReasonImagesRemoved = "ImagesRemoved"
	// ReasonImageGCFailed: GC failed (Warning, the kubelet's reason).
	ReasonImageGCFailed = "ImageGCFailed"
	// ReasonFreeDiskSpaceFailed: the cache stays over its size bound
	// because the images left are used by VMs (Warning, the kubelet's
	// reason).
	ReasonFreeDiskSpaceFailed = "FreeDiskSpaceFailed"
)

// ImageGC bounds the image cache: every Period it removes images no VM uses
// that are older than the policy's age or beyond its size, and reports what
// it did as node events.
type ImageGC struct {
	Store  *oci.Store
	Policy oci.GCPolicy
	Period time.Duration
	// Event records a node event (type, reason, message).
	Event func(eventType, reason, message string)
}

// Run collects every Period until ctx ends.
func (g ImageGC) Run(ctx context.Context) {
	if g.Period <= 0 || (g.Policy.MaxBytes <= 0 && g.Policy.MaxAge <= 0) {
		return
	}
	t := time.NewTicker(g.Period)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			_, _ = g.Once(ctx)
		}
	}
}

// Once runs one collection and records its events.
func (g ImageGC) Once(ctx context.Context) (oci.GCResult, error) {
	res, err := g.Store.GC(ctx, g.Policy)
	log := klog.FromContext(ctx)
	event := g.Event
	if event == nil {
		event = func(string, string, string) {}
	}
	if err != nil {
		log.Error(err, "Image garbage collection failed")
		event(corev1.EventTypeWarning, ReasonImageGCFailed, fmt.Sprintf("image garbage collection failed: %v", err))
		return res, err
	}
	if n := len(res.Removed); n > 0 {
		msg := fmt.Sprintf("removed %d unused image(s), freed %s; cache holds %s", n, bytesQ(res.FreedBytes), bytesQ(res.TotalBytes))
		log.Info("Image garbage collection", "removed", res.Removed, "freed", res.FreedBytes, "total", res.TotalBytes)
		event(corev1.EventTypeNormal, ReasonImagesRemoved, msg)
	}
	if g.Policy.MaxBytes > 0 && res.TotalBytes > g.Policy.MaxBytes {
		event(corev1.EventTypeWarning, ReasonFreeDiskSpaceFailed, fmt.Sprintf(
			"image cache holds %s, over its %s bound: %d image(s) in use by VMs cannot be removed",
			bytesQ(res.TotalBytes), bytesQ(g.Policy.MaxBytes), res.KeptInUse))
	}
	return res, nil
}

func bytesQ(b int64) string { return resource.NewQuantity(b, resource.BinarySI).String() }
